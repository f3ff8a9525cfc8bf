"""TorchTitan's TOML configs of three layouts load unchanged (issue 16).

``tests/assets/torchtitan/<era>/`` holds, for each layout, TorchTitan's ``debug_model.toml`` and
``llama3_8b.toml`` (every key and value those files set) and ``all_keys_at_defaults.toml``: every
key of that layout's job config at TorchTitan's default (keys with no default commented out).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO_ROOT, read_jsonl
from torchtitan_lite import train
from torchtitan_lite.config import ConfigError, load_job_config
from torchtitan_lite.config.cli import tomllib
from torchtitan_lite.config.schema import SECTIONS, field_types
from torchtitan_lite.config.torchtitan import ERAS, TORCHTITAN_KEYS, lookup, migration_markdown

ASSETS = REPO_ROOT / "tests" / "assets" / "torchtitan"


def _era_keys(era: str) -> list[str]:
    """Every dotted key of ``all_keys_at_defaults.toml``, the commented-out ones too."""
    keys, section = [], None
    for line in (ASSETS / era / "all_keys_at_defaults.toml").read_text().splitlines():
        if m := re.fullmatch(r"\[([\w.]+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"#? ?(\w+) = ", line)):
            keys.append(f"{section}.{m.group(1)}")
    return keys


def _flat(table: dict, prefix: str = "") -> list[str]:
    return [k for key, v in table.items()
            for k in (_flat(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]


def _ours(name: str) -> bool:
    section, _, key = name.partition(".")
    return section in SECTIONS and key in field_types(SECTIONS[section])


@pytest.mark.parametrize("era", list(ERAS))
def test_every_key_of_each_layout_is_ours_or_in_the_table(era):
    keys = _era_keys(era)
    assert len(keys) > 70
    for name in keys:
        entry = lookup(name)
        assert _ours(name) or entry is not None, f"{era}: {name} is neither our key nor in the table"
        if entry is not None:
            assert era in entry.eras, f"{name}: the table does not list {era}"
    # The table claims no layout a key is not in.
    for entry in TORCHTITAN_KEYS:
        for listed in entry.eras:
            assert entry.name in _era_keys(listed), f"{entry.name} is not a key of {listed}"


@pytest.mark.parametrize("era", list(ERAS))
def test_every_key_at_torchtitans_default_loads(era):
    notes: list[str] = []
    config = load_job_config(["--job.config_file", str(ASSETS / era / "all_keys_at_defaults.toml")], notes=notes)
    set_keys = _flat(tomllib.loads((ASSETS / era / "all_keys_at_defaults.toml").read_text()))
    renamed = {k for k in set_keys if (e := lookup(k)) is not None and e.kind == "alias"}
    no_effect = {
        k for k in set_keys if (e := lookup(k)) is not None and e.kind == "off" and e.neutral_text == "any value"
    }
    noted = {re.match(r"'?([\w.]+)'?", n).group(1) for n in notes}
    assert noted == renamed | no_effect, (noted ^ (renamed | no_effect))
    assert all(re.search(r"is TorchTitan's name \(|has no effect here: \w", n) for n in notes), notes
    if era == "2025-02":
        assert config.training.local_batch_size == 8 and config.lr_scheduler.warmup_steps == 200
        assert "training.batch_size" in noted and "checkpoint.enable_checkpoint" in noted
    if era == "2026-02":
        assert config.checkpoint.last_save_model_only is True  # TorchTitan's default there
        assert config.model.tokenizer_path == "./tests/assets/tokenizer"  # its hf_assets_path


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_features_we_lack_are_one_line_each_and_off_values_load(tmp_path, capsys):
    path = _write(tmp_path, """
[parallelism]
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
[model]
converters = ["mx"]
[fault_tolerance]
enable = true
replica_id = 3
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
[activation_checkpoint]
mode = "memory_budget"
""")
    assert train.main(["--job.config_file", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if not x.startswith("note: ")]
    assert len(lines) == 3, lines
    # Keys that change nothing are noted, also when the config is refused.
    assert "note: 'fault_tolerance.replica_id' (TorchTitan) has no effect here: used only with TorchFT" in err[0], err
    assert any("activation_checkpoint.mode = 'memory_budget' asks for activation checkpointing under a memory "
               "budget" in x and "reshard_after_forward_mode" in x for x in lines), lines
    for key, feature in [
                         ("model.converters = ['mx']", "MX (microscaling)"),
                         ("fault_tolerance.enable = true", "TorchFT")]:
        (line,) = [x for x in lines if key in x]
        assert line.startswith("error: ") and feature in line and "does not have" in line, line
    # Degrees of dimensions the model family does not split over: one line each when the job is
    # planned (they are ours now; the family's parallelize decides).
    for key, value, name in [("expert_parallel_degree", 2, "expert parallel")]:
        assert train.main([f"--parallelism.{key}", str(value)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: parallelism.{key}: invalid value {value}; model 'llama3' does not split over {name} ranks "
            "(its parallelize handles context parallel, pipeline, tensor parallel); expected 1")
    # Context parallel is every family's: a degree the world cannot hold is the mesh's one line.
    assert train.main(["--parallelism.context_parallel_degree", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: parallelism.context_parallel_degree=4 × parallelism.tensor_parallel_degree=1 = 4 does not divide "
        "the world size 1")
    # The same keys asking for nothing load without a word.
    notes: list[str] = []
    load_job_config(["--job.config_file", _write(tmp_path, """
[parallelism]
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
[metrics]
enable_wandb = false
[model]
converters = []
""")], notes=notes)
    assert notes == []


def test_renamed_keys_set_ours_with_a_note_from_file_and_command_line(tmp_path):
    notes: list[str] = []
    config = load_job_config([
        "--job.config_file", _write(tmp_path, """
[training]
batch_size = 3
compile = true
fsdp_reshard_after_forward = "never"
[optimizer]
fused = true
[checkpoint]
enable_checkpoint = true
async_mode = "async_with_pinned_mem"
[lr_scheduler]
lr_min = 0.1
"""),
        "--training.seed", "7", "--checkpoint.no-enable_checkpoint", "--lr_scheduler.lr_min=0.2",
        "--experimental.pipeline_parallel_degree", "1", "--quantize.linear.float8.emulate", "true",
    ], notes=notes)
    assert config.training.local_batch_size == 3 and config.compile.enable
    assert config.parallelism.reshard_after_forward_mode == "never"
    assert config.optimizer.implementation == "fused" and config.checkpoint.async_mode == "async"
    assert any(n.startswith("checkpoint.async_mode = 'async_with_pinned_mem' is TorchTitan's spelling of 'async'")
               for n in notes), notes
    assert config.checkpoint.enable is False  # the command line wins
    assert config.lr_scheduler.min_lr_factor == 0.2 and config.debug.seed == 7
    assert any(n.startswith("'training.batch_size' is TorchTitan's name (2025-02) of 'training.local_batch_size'")
               for n in notes), notes
    assert len(notes) == len(set(notes))


def test_a_string_for_a_list_is_a_comma_list_as_in_torchtitans_files(tmp_path):
    """TorchTitan's early-2025 files write some lists as strings (its llama3_405b.toml:
    ``converters = "float8"``, ``filter_fqns = "output"``); they read as comma lists, as the
    command line's do."""
    config = load_job_config(["--job.config_file", _write(tmp_path, """
[model]
converters = "float8"
[float8]
filter_fqns = "output, router.gate"
""")])
    assert config.model.converters == ["float8"] and config.float8.filter_fqns == ["output", "router.gate"]


def test_two_names_of_one_key_must_agree(tmp_path):
    path = _write(tmp_path, "[training]\nbatch_size = 3\nlocal_batch_size = 4\n")
    with pytest.raises(ConfigError, match=r"'training.batch_size' = 3 and 'training.local_batch_size' = 4 .* "
                                          r"both set 'training.local_batch_size'"):
        load_job_config(["--job.config_file", path])
    load_job_config(["--job.config_file", _write(tmp_path, "[training]\nbatch_size = 4\nlocal_batch_size = 4\n")])


def test_hf_assets_path_is_also_the_initial_load_with_initial_load_in_hf(tmp_path):
    """As in TorchTitan: with checkpointing on and initial_load_in_hf, hf_assets_path is also the
    Hugging Face folder to start from (unless initial_load_path is given); without checkpointing
    nothing is loaded; a tokenizer_path beside it wins for the tokenizer."""
    path = _write(tmp_path, '[model]\nhf_assets_path = "assets/hf/x"\n'
                            '[checkpoint]\nenable = true\ninitial_load_in_hf = true\n')
    config = load_job_config(["--job.config_file", path])
    assert config.model.tokenizer_path == "assets/hf/x" and config.checkpoint.initial_load_path == "assets/hf/x"
    config = load_job_config(["--job.config_file", path, "--checkpoint.initial_load_path", "other"])
    assert config.checkpoint.initial_load_path == "other"
    config = load_job_config(["--job.config_file", path, "--checkpoint.no-enable",
                              "--checkpoint.no-initial_load_in_hf"])
    assert config.checkpoint.initial_load_path is None
    notes: list[str] = []
    both = _write(tmp_path, '[model]\nhf_assets_path = "assets/hf/x"\ntokenizer_path = "tok.model"\n'
                            '[checkpoint]\nenable = true\ninitial_load_in_hf = true\n')
    config = load_job_config(["--job.config_file", both], notes=notes)
    assert config.model.tokenizer_path == "tok.model" and config.checkpoint.initial_load_path == "assets/hf/x"
    assert any("'model.tokenizer_path' is the tokenizer" in n for n in notes), notes


# Unknown keys: a hint only when it is the same setting. The first group were wrong hints of
# the keys TorchTitan users bring (they now load); the rest are typos and keys of nowhere.
@pytest.mark.parametrize("arg, hint", [
    ("--checkpoint.enable_checkpiont", "checkpoint.enable_checkpoint"),
    ("--training.stepz", "training.steps"),
    ("--training.local_batchsize", "training.local_batch_size"),
    ("--parallelism.tensor_parallel_degre", "parallelism.tensor_parallel_degree"),
    ("--lr_schedular.warmup_steps", "lr_scheduler.warmup_steps"),
    ("--optimizer.warmup_steps", "lr_scheduler.warmup_steps"),  # and TorchTitan's training.warmup_steps
    ("--job.steps", None),  # training.steps or validation.steps: no guess
    ("--model.seed", "debug.seed"),  # the only other key of that name
    ("--training.sequence_parallel_degree", None),
    ("--parallelism.expert_degree", None),
    ("--checkpoint.enable_ft", None),
    ("--model.tokenizer", None),
    ("--activation_checkpointing.mode", "activation_checkpoint.mode"),
    ("--job.use_for_tests", None),
    ("--float16.emulate", "float8.emulate"),  # the one section with that key, two letters away
    # A key of that name elsewhere is no hint when the section has a close spelling, or when
    # the name never moved between sections.
    ("--checkpoint.enabled", "checkpoint.enable"),
    ("--compile.enabled", "compile.enable"),
    ("--metrics.enabled", None),
    ("--profiling.folder", None),
    ("--validation.interval", None),
    ("--validation.log_freq", None),
    ("--validation.max_norm", None),
    ("--checkpoint.deterministic", "debug.deterministic"),  # TorchTitan's training.deterministic moved
])
def test_did_you_mean_only_for_the_same_setting(arg, hint):
    with pytest.raises(ConfigError) as err:
        load_job_config([arg, "1"])
    message = str(err.value)
    assert "\n" not in message
    if hint is None:
        assert "did you mean" not in message, message
    else:
        assert f"did you mean '{hint}'?" in message, message


@pytest.mark.parametrize("era", list(ERAS))
def test_no_key_of_torchtitan_gets_a_hint(era):
    """Every key of every layout is read (loaded, or refused as a feature we lack): none is
    'unknown' with a guess at another setting."""
    for name in _era_keys(era):
        try:
            load_job_config([f"--{name}=1"])
        except ConfigError as exc:
            assert "unknown" not in str(exc) and "did you mean" not in str(exc), (name, str(exc))


def test_migration_doc_is_generated_from_the_table():
    doc = (REPO_ROOT / "docs" / "migrating_from_torchtitan.md").read_text()
    start = doc.index("<!-- key table: generated")
    body = doc[doc.index("\n", start) + 1:doc.index("<!-- end of key table -->")]
    assert body == migration_markdown(), (
        "docs/migrating_from_torchtitan.md is out of date: regenerate it with "
        "python -c 'from torchtitan_lite.config.torchtitan import migration_markdown; print(migration_markdown())'"
    )


# --------------------------------------------------------------------------------------------
# Each layout's debug_model.toml and llama3_8b.toml train unchanged (2 steps, 1 CPU process)
# --------------------------------------------------------------------------------------------

# Sizing for a CPU: 2 steps of short windows, the debug shape for the 8B, and fp32 compute (CPUs
# without native bf16 matmul run bf16 through a reference kernel, tens of times slower).
CPU_SIZE = ["--training.steps", "2", "--training.seq_len", "64", "--model.flavor", "debugmodel",
            "--training.mixed_precision_param", "float32"]


def _tiktoken_model(path: Path) -> None:
    """A small tiktoken BPE file (Meta's format: base64 token and rank per line)."""
    import base64

    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b"in", b"an", b"er", b" the", b"re", b"on"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))


def _workspace(root: Path) -> None:
    """What TorchTitan's configs point at, relative to where they run: tokenizers and c4_test."""
    from tests.data_helpers import train_hf_tokenizer

    for folder in ("tests/assets/tokenizer", "assets/hf/Llama-3.1-8B"):
        train_hf_tokenizer(root / folder, special=("<|begin_of_text|>", "<|end_of_text|>"))
        (root / folder / "tokenizer_config.json").write_text(
            '{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}')
    for file in ("tests/assets/test_tiktoken.model", "assets/tokenizer/original/tokenizer.model",
                 "torchtitan/datasets/tokenizer/original/tokenizer.model"):
        _tiktoken_model(root / file)
    c4 = root / "tests/assets/c4_test"
    c4.mkdir(parents=True)
    import json

    text = (Path(sys.modules["json"].__file__).parent / "decoder.py").read_text()
    docs = [text[i:i + 700] for i in range(0, len(text), 700)]
    (c4 / "data.json").write_text("".join(json.dumps({"text": d, "timestamp": "2019", "url": "x"}) + "\n"
                                          for d in docs))


def _run_config(root: str, config: str, extra: list[str]) -> dict:
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        code = train.main(["--job.config_file", config, *CPU_SIZE, *extra])
        metrics = read_jsonl(Path(root) / "outputs" / "metrics.jsonl")
        return {"code": code, "losses": [r["loss"] for r in metrics]}
    finally:
        os.chdir(cwd)


@pytest.mark.slow
@pytest.mark.parametrize("era", list(ERAS))
@pytest.mark.parametrize("name", ["debug_model", "llama3_8b"])
def test_torchtitan_config_trains_unchanged(tmp_path, era, name):
    from tests.dist_utils import run_distributed

    _workspace(tmp_path)
    extra = ["--training.batch_size" if era == "2025-02" else "--training.local_batch_size", "2"]
    if name == "llama3_8b":
        # c4 needs a download: point it at local files (here c4_test's) instead.
        extra += ["--training.dataset_path", str(tmp_path / "tests/assets/c4_test")]
    (result,) = run_distributed(_run_config, 1, str(tmp_path), str(ASSETS / era / f"{name}.toml"), extra)
    assert result["code"] == 0
    losses = result["losses"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses


@pytest.mark.slow
def test_torchtitan_8b_config_trains_at_tensor_parallel_2(tmp_path):
    """TorchTitan's last TOML-era llama3_8b.toml with tensor_parallel_degree = 2 (the debug shape,
    2 ranks: data parallel 1 × tensor parallel 2) trains; both ranks log the same losses. (That
    tensor parallel gives one process's losses: tests/test_tensor_parallel.py.)"""
    from tests.dist_utils import run_distributed

    _workspace(tmp_path)
    config = tmp_path / "llama3_8b.toml"
    config.write_text((ASSETS / "2026-02" / "llama3_8b.toml").read_text().replace(
        "tensor_parallel_degree = 1", "tensor_parallel_degree = 2"))
    extra = ["--training.local_batch_size", "2", "--training.dataset_path", str(tmp_path / "tests/assets/c4_test")]
    ranks = run_distributed(_run_config, 2, str(tmp_path), str(config), extra)
    assert [r["code"] for r in ranks] == [0, 0]
    losses = ranks[0]["losses"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
