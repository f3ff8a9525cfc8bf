"""The command line: user errors as one clean line with their exit code (2 config, 3 data), through
``main(argv)`` in-process and once through the real entry point; CLI syntax and TOML precedence;
``--help``. The README's default job (100 steps through torchrun) is the integration runner's
``debug_model_default`` case."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import REPO_ROOT, run_command
from torchtitan_lite.config import ConfigError, JobConfig, load_job_config
from torchtitan_lite.config.schema import coerce
from torchtitan_lite.job import plan_job, preflight
from torchtitan_lite.train import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEBUG_TOML = REPO_ROOT / "train_configs" / "debug_model.toml"


# --------------------------------------------------------------------------------------------
# 1. User errors: exit code 2 (config) or 3 (data), exactly one stderr line naming the key
# --------------------------------------------------------------------------------------------


def _bad_toml_unknown_key(tmp: Path) -> list[str]:
    path = tmp / "bad.toml"
    path.write_text('[training]\nsteps = 3\nstepz = 4\n')
    return ["--job.config_file", str(path)]


def _literal(*argv: str):
    return lambda _tmp: list(argv)


def _empty_text_dataset(tmp: Path) -> list[str]:
    (tmp / "empty.txt").write_text("")
    return ["--training.dataset", "text", "--training.dataset_path", str(tmp / "empty.txt")]


def _tokens_beyond_vocab(tmp: Path) -> list[str]:
    import numpy as np

    np.save(tmp / "gpt2_tokens.npy", np.array([464, 2068, 50256], dtype=np.uint16))
    return ["--training.dataset", "tokens", "--training.dataset_path", str(tmp / "gpt2_tokens.npy")]


BAD_CONFIGS = [
    # id, argv builder, extra env, exit code, strings the single stderr line must contain
    pytest.param(_literal("--trainin.steps", "3"), {}, 2, ["[trainin]", "did you mean"], id="unknown-section"),
    pytest.param(_literal("--training.stepz", "3"), {}, 2, ["training.stepz", "did you mean 'training.steps'"],
                 id="unknown-key"),
    pytest.param(_literal("--training.steps", "abc"), {}, 2, ["training.steps", "'abc'"], id="wrong-type"),
    pytest.param(_literal("--training.mixed_precision_param", "fp8"), {}, 2,
                 ["training.mixed_precision_param", "'fp8'", "float32"], id="bad-enum"),
    pytest.param(_literal("--parallelism.data_parallel_shard_degree", "3"), {}, 2,
                 ["parallelism.data_parallel_shard_degree=3", "world size 1"], id="shard-degree-3-on-1-process"),
    pytest.param(_literal("--parallelism.data_parallel_replicate_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "3"), {"WORLD_SIZE": "4"}, 2,
                 ["data_parallel_replicate_degree=2", "data_parallel_shard_degree=3", "world size 4"],
                 id="degrees-2x3-on-world-4"),
    pytest.param(_literal("--parallelism.reshard_after_forward_mode", "3"), {}, 2,
                 ["parallelism.reshard_after_forward_mode"], id="bad-int-reshard-mode"),
    pytest.param(_literal("--job.config_file", "does/not/exist.toml"), {}, 2,
                 ["job.config_file", "does/not/exist.toml"], id="missing-config-file"),
    pytest.param(_bad_toml_unknown_key, {}, 2, ["training.stepz", "bad.toml", "did you mean 'training.steps'"],
                 id="unknown-key-in-toml"),
    pytest.param(_literal("--training.dataset", "txt"), {}, 2, ["training.dataset", "'txt'"], id="bad-dataset-name"),
    # Data: the path is checked in preflight; content before any process group exists.
    pytest.param(_literal("--training.dataset", "text", "--training.dataset_path", "no/such/corpus"), {}, 3,
                 ["training.dataset_path", "no/such/corpus", "not found"], id="bad-dataset-path"),
    pytest.param(_empty_text_dataset, {}, 3, ["training.dataset_path", "empty.txt", "is empty"], id="empty-dataset"),
    pytest.param(_tokens_beyond_vocab, {}, 3,
                 ["training.dataset_path", "gpt2_tokens.npy", "token id 50256", "258"],
                 id="tokens-beyond-tokenizer-vocab"),
    pytest.param(_literal("--model.vocab_size", "200"), {}, 2, ["model.vocab_size", "200", "258"],
                 id="vocab-smaller-than-tokenizer"),
]


def _run_bad(argv: list[str], env: dict[str, str], code: int, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    returned = main(argv)
    out, err = capsys.readouterr()
    output = f"rc={returned}\nstdout:\n{out}\nstderr:\n{err}"
    assert returned == code, output
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert out == "", output  # rejected before anything started
    return lines[0], output


@pytest.mark.parametrize(("build_argv", "env", "code", "expected"), BAD_CONFIGS)
def test_bad_config_is_one_line_and_its_exit_code(tmp_path: Path, build_argv, env: dict[str, str], code: int,
                                                  expected: list[str], capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written: the job never starts
    line, output = _run_bad(build_argv(tmp_path), env, code, capsys, monkeypatch)
    assert line.startswith("error: "), output
    for text in expected:
        assert text in line, f"{text!r} not in the error line\n{output}"
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "bad.toml"], [tmp_path / "empty.txt"],
                                        [tmp_path / "gpt2_tokens.npy"]), output


@pytest.mark.slow
def test_bad_config_through_the_real_entry_point() -> None:
    """The same through ``python -m torchtitan_lite.train``: one stderr line, no traceback, exit 2."""
    result = run_command([sys.executable, "-m", "torchtitan_lite.train", "--training.stepz", "3"], timeout=120)
    output = f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 2, output
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, output
    assert result.stderr.startswith("error: unknown key 'training.stepz'"), output


def test_config_file_none_means_no_file() -> None:
    from torchtitan_lite.config import load_job_config

    assert load_job_config(["--job.config_file", "none"]).job.config_file is None


# The same error classes, and a few more, in-process (fast): each is a ConfigError whose single
# line names the key.
IN_PROCESS_BAD = [
    (["--optimizer.lr", "fast"], None, "optimizer.lr"),
    (["--debug.deterministic", "maybe"], None, "debug.deterministic"),
    (["--job.no-dump_folder"], None, "job.dump_folder"),
    (["--training.steps"], None, "training.steps"),
    (["--training.steps", "0"], None, "training.steps"),
    (["--model.flavor", "huge"], None, "model.flavor"),
    (["--parallelism.reshard_after_forward_mode", "sometimes"], None, "parallelism.reshard_after_forward_mode"),
    (["--parallelism.reshard_after_forward_mode", "2"], 2, "parallelism.reshard_after_forward_mode"),
    (["--training.local_batch_size", "4", "--training.global_batch_size", "6"], 1, "training.global_batch_size"),
    (["--training.local_batch_size", "2", "--training.global_batch_size", "6"], 2, "training.global_batch_size"),
    (["steps"], None, "'steps'"),
    (["--debug.seed", "-1"], None, "debug.seed"),
    (["--debug.seed", str(2**64)], None, "debug.seed"),
    (["--optimizer.lr", "inf"], None, "optimizer.lr"),
    (["--optimizer.weight_decay", "nan"], None, "optimizer.weight_decay"),
    (["--training.max_norm", "inf"], None, "training.max_norm"),
    (["--job.dump_folder", "/proc/version/run"], None, "job.dump_folder"),
    (["--job.description", "--foo.bar"], None, "job.description"),
]


@pytest.mark.parametrize(("argv", "world_size", "key"), IN_PROCESS_BAD)
def test_bad_config_in_process(argv: list[str], world_size: int | None, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config = load_job_config(argv)
        preflight(config)
        plan_job(config, world_size=world_size or 1)
    lines = str(info.value).splitlines()
    assert key in lines[0]
    # One line; "--job.description --foo.bar" is two problems (a missing value, an unknown
    # section), reported together.
    assert len(lines) == (2 if "--foo.bar" in argv else 1), lines


@pytest.mark.parametrize(
    ("toml_text", "key"),
    [
        ("[trainin]\nsteps = 3\n", "[trainin]"),
        ('[training]\nsteps = "ten"\n', "training.steps"),
        ("[training]\nsteps = 3.5\n", "training.steps"),
        ("[debug]\ndeterministic = 1\n", "debug.deterministic"),
        ('[optimizer]\nname = "SGD"\n', "optimizer.name"),
        ("[training]\nsteps = \n", "job.config_file"),
        ("training = 3\n", "training"),
        ('[job]\nconfig_file = "other.toml"\n', "job.config_file"),
    ],
)
def test_bad_toml_in_process(tmp_path: Path, toml_text: str, key: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(toml_text)
    with pytest.raises(ConfigError) as info:
        load_job_config(["--job.config_file", str(path)])
    assert key in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# 3. CLI syntax and precedence (in-process), and --help
# --------------------------------------------------------------------------------------------


def test_cli_key_value_forms() -> None:
    c = load_job_config([
        "--training.steps=7",
        "--optimizer.lr", "1e-4",
        "--training.global_batch_size", "-1",
        "--job.description=a b=c",
        "--lr_scheduler.decay_ratio", "0.25",
        "--training.dataset_path", "none",
        "--parallelism.reshard_after_forward_mode=always",
    ])
    assert c.training.steps == 7 and isinstance(c.training.steps, int)
    assert c.optimizer.lr == 1e-4 and isinstance(c.optimizer.lr, float)
    assert c.training.global_batch_size == -1
    assert c.job.description == "a b=c"
    assert c.lr_scheduler.decay_ratio == 0.25
    assert c.training.dataset_path is None
    assert c.parallelism.reshard_after_forward_mode == "always"
    # Untouched keys keep their defaults.
    assert c.training.seq_len == JobConfig().training.seq_len
    # An integer reshard mode is parsed as an int; the plan checks it against the shard degree.
    c = load_job_config(["--parallelism.reshard_after_forward_mode", "2"])
    assert c.parallelism.reshard_after_forward_mode == 2
    assert plan_job(c, world_size=4).shape.reshard_after_forward_mode == 2
    # The last occurrence wins; hyphens in keys are accepted.
    c = load_job_config(["--training.steps", "3", "--training.steps", "5", "--training.local-batch-size", "3"])
    assert c.training.steps == 5 and c.training.local_batch_size == 3


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["--debug.deterministic"], True),
        (["--debug.deterministic", "--training.steps", "3"], True),
        (["--debug.deterministic", "true"], True),
        (["--debug.deterministic", "false"], False),
        (["--debug.deterministic=true"], True),
        (["--debug.deterministic=False"], False),
        (["--debug.deterministic", "--debug.no-deterministic"], False),
        (["--debug.no-deterministic", "--debug.deterministic"], True),
        (["--debug.no_deterministic"], False),
        (["--debug.deterministic", "0"], False),
        (["--debug.deterministic", "yes"], True),
    ],
)
def test_cli_boolean_flags(argv: list[str], expected: bool) -> None:
    c = load_job_config(argv)
    assert c.debug.deterministic is expected
    if "--training.steps" in argv:
        assert c.training.steps == 3


def test_no_flag_on_a_non_boolean_is_an_error() -> None:
    with pytest.raises(ConfigError, match="training.steps"):
        load_job_config(["--training.no-steps"])
    with pytest.raises(ConfigError, match="takes no value"):
        load_job_config(["--debug.no-deterministic=true"])


def test_toml_then_cli_precedence(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        "[training]\nsteps = 5\nseq_len = 128\n\n"
        "[optimizer]\nlr = 1e-3\n\n"
        "[debug]\ndeterministic = true\nseed = 7\n\n"
        "[parallelism]\nreshard_after_forward_mode = 2\n"
    )
    defaults = JobConfig()

    c = load_job_config(["--job.config_file", str(path)])
    assert (c.training.steps, c.training.seq_len, c.optimizer.lr) == (5, 128, 1e-3)
    assert c.debug.deterministic is True and c.debug.seed == 7
    assert c.parallelism.reshard_after_forward_mode == 2
    assert c.job.config_file == str(path)
    assert c.training.local_batch_size == defaults.training.local_batch_size

    # The command line wins over the file, wherever --job.config_file appears.
    for argv in (
        ["--job.config_file", str(path), "--training.steps", "9", "--debug.no-deterministic"],
        ["--training.steps=9", "--debug.no-deterministic", f"--job.config_file={path}"],
    ):
        c = load_job_config(argv)
        assert c.training.steps == 9
        assert c.debug.deterministic is False
        # Keys only in the file still come from the file; the rest are defaults.
        assert (c.training.seq_len, c.optimizer.lr, c.debug.seed) == (128, 1e-3, 7)
        assert c.optimizer.beta2 == defaults.optimizer.beta2


def test_debug_model_toml_loads() -> None:
    data = tomllib.loads(DEBUG_TOML.read_text())
    c = load_job_config(["--job.config_file", str(DEBUG_TOML)])
    plan_job(c, world_size=2)
    for section, values in data.items():
        for key, value in values.items():
            assert getattr(getattr(c, section), key) == value, f"{section}.{key}"


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


@pytest.mark.slow
def test_help_lists_every_field_with_default() -> None:
    result = run_command([sys.executable, "-m", "torchtitan_lite.train", "--help"], timeout=120)
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert "Traceback" not in result.stderr, output
    lines = result.stdout.splitlines()
    option_lines = {line.split()[0]: line for line in lines if line.startswith("  --")}

    expected_options = set()
    for section_field in dataclasses.fields(JobConfig):
        section = section_field.name
        assert f"[{section}]" in lines, f"no [{section}] header\n{output}"
        for f in dataclasses.fields(section_field.default_factory()):
            option = f"--{section}.{f.name}"
            expected_options.add(option)
            assert option in option_lines, f"{option} missing from --help\n{output}"
            default = _field_default(f)
            assert f"(default: {default!r})" in option_lines[option], option_lines[option]
            # Each option is followed by its documentation line.
            index = lines.index(option_lines[option])
            assert lines[index + 1].startswith("      ") and lines[index + 1].strip(), option
    assert set(option_lines) == expected_options


def test_short_help_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    assert "--training.steps" in out and "usage:" in out


def test_list_values_are_comma_separated() -> None:
    assert coerce("s.k", "a, b,c", list[str], from_cli=True) == ["a", "b", "c"]
    assert coerce("s.k", "1,2", list[int], from_cli=True) == [1, 2]
    assert coerce("s.k", [1, 2], list[int], from_cli=False) == [1, 2]
    with pytest.raises(ConfigError, match="s.k"):
        coerce("s.k", "1,x", list[int], from_cli=True)
    # or written as in a TOML file, brackets and all
    assert coerce("s.k", "[1.0, 0.1]", list[float], from_cli=True) == [1.0, 0.1]
    assert coerce("s.k", '["a", "b"]', list[str], from_cli=True) == ["a", "b"]
    assert coerce("s.k", "[a, b]", list[str], from_cli=True) == ["a", "b"]
    assert coerce("s.k", "[]", list[str], from_cli=True) == []
    assert load_job_config(["--grpo.reward_weights", "[1.0, 0.1]", "--grpo.reward_functions", "[accuracy, format]"],
                           ).grpo.reward_weights == [1.0, 0.1]


def test_checks_run_once_and_leave_the_config_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A real one-step job through ``main``: the schema checks, the preflight and the plan each run
    exactly once (the trainer reads the plan instead of checking again), and none changes the config."""
    import copy

    import torchtitan_lite.config.cli as cli
    import torchtitan_lite.train as train
    from tests.conftest import TINY_ARGS

    calls: dict[str, int] = {}
    configs = []

    def counted(name: str, function):
        def wrapper(config, *args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            before = copy.deepcopy(config)
            result = function(config, *args, **kwargs)
            assert config == before, f"{name} changed the config"
            configs.append(config)
            return result
        return wrapper

    monkeypatch.setattr(cli, "validate_config", counted("validate_config", cli.validate_config))
    monkeypatch.setattr(train, "preflight", counted("preflight", train.preflight))
    monkeypatch.setattr(train, "plan_job", counted("plan_job", train.plan_job))
    import torchtitan_lite.trainer as trainer

    monkeypatch.setattr(trainer, "preflight", counted("preflight", trainer.preflight))
    monkeypatch.setattr(trainer, "plan_job", counted("plan_job", trainer.plan_job))
    argv = [*TINY_ARGS, "--training.steps", "1", "--parallelism.reshard_after_forward_mode", "never",
            "--job.dump_folder", str(tmp_path)]
    assert train.main(argv) == 0, capsys.readouterr()
    assert calls == {"validate_config": 1, "preflight": 1, "plan_job": 1}
    assert all(c is configs[0] for c in configs)  # one config object travels the whole path
    assert configs[0].parallelism.reshard_after_forward_mode == "never"


def test_every_problem_of_a_config_is_one_line_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three unknown keys in the file and two bad values on the command line: five lines, exit 2,
    before anything else runs."""
    from torchtitan_lite.train import main

    toml = tmp_path / "job.toml"
    toml.write_text('[training]\nstepz = 10\nseq_len = 64\n[optimizer]\nlrr = 1e-3\n[model]\nflavour = "tiny"\n')
    code = main(["--job.config_file", str(toml), "--training.local_batch_size", "many",
                 "--metrics.log_freq", "-x"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 5, lines
    assert all(line.startswith("error: ") for line in lines)
    joined = "\n".join(lines)
    for fragment in ("'training.stepz'", "'optimizer.lrr'", "'model.flavour'", "training.local_batch_size",
                     "metrics.log_freq"):
        assert fragment in joined, (fragment, joined)


def test_every_broken_rule_between_values_is_one_line_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Values of the right types that break five rules of the config: five lines, exit 2."""
    from torchtitan_lite.train import main

    code = main(["--optimizer.lr", "-1", "--training.max_rollbacks", "-2", "--lr_scheduler.decay_ratio", "1.5",
                 "--checkpoint.keep_latest_k", "-1", "--parallelism.memory_budget_gib", "8"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 5, lines
    for key in ("optimizer.lr", "training.max_rollbacks", "lr_scheduler.decay_ratio", "checkpoint.keep_latest_k",
                "parallelism.memory_budget_gib"):
        assert sum(line.startswith(f"error: {key}: ") for line in lines) == 1, (key, lines)


def test_compile_backend_is_checked_against_torchs_registry() -> None:
    """compile.backend: any registered backend (aot_eager, a debugging one, included); another
    name is one line listing the usual ones."""
    from torchtitan_lite.job import plan_job

    plan = plan_job(load_job_config(["--compile.enable", "--compile.backend", "aot_eager"]), world_size=1)
    assert plan.shape.world_size == 1
    with pytest.raises(ConfigError, match=r"compile.backend: invalid value 'nope'; expected a registered "
                                          r"torch.compile backend, e.g. .*inductor.*aot_eager"):
        plan_job(load_job_config(["--compile.enable", "--compile.backend", "nope"]), world_size=1)


def test_five_bad_keys_are_five_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Five different unknown keys in one TOML file: five error lines, exit 2."""
    from torchtitan_lite.train import main

    toml = tmp_path / "job.toml"
    toml.write_text('[training]\nstepz = 10\nbatchsize = 4\n[optimizer]\nlrr = 1e-3\n[model]\nflavour = "tiny"\n'
                    "[checkpoint]\nintervall = 5\n")
    assert main(["--job.config_file", str(toml)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 5 and all(line.startswith("error: unknown key '") for line in lines), lines
    for key in ("training.stepz", "training.batchsize", "optimizer.lrr", "model.flavour", "checkpoint.intervall"):
        assert sum(f"'{key}'" in line for line in lines) == 1, (key, lines)


def test_bad_values_and_broken_rules_are_reported_together(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           ) -> None:
    """A value the schema refuses (``loss_type = "dapoo"``) does not hide the ranges of the others
    (``temperature = -1.0``) nor the rules between values (``lr_scheduler.total_steps``): one line
    each, in one run, exit 2; a rule about the refused key itself (training.steps = 'x', which
    total_steps is compared with) is left out, not reported against its default."""
    from torchtitan_lite.train import main

    toml = tmp_path / "job.toml"
    toml.write_text('[grpo]\nloss_type = "dapoo"\ntemperature = -1.0\n[dpo]\nbeta = 0\n'
                    '[lr_scheduler]\ntotal_steps = 5\n[training]\nsteps = "x"\n')
    assert main(["--job.config_file", str(toml), "--grpo.top_p", "2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [line.split(":")[1].strip() for line in lines] == [
        "grpo.loss_type", "training.steps", "dpo.beta", "grpo.temperature", "grpo.top_p"], lines
    assert lines[0] == ("error: grpo.loss_type: invalid value 'dapoo'; expected one of 'grpo', 'dr_grpo', 'dapo', "
                        "'bnpo', 'cispo'")
    assert lines[3] == "error: grpo.temperature: invalid value -1.0; expected a number >= 0 (0: greedy)"


def test_a_config_built_in_code_reports_its_types_and_its_rules_together() -> None:
    from torchtitan_lite.config.schema import validate_config

    config = JobConfig()
    config.grpo.loss_type = "dapoo"  # type: ignore[assignment]
    config.grpo.temperature = -1.0
    with pytest.raises(ConfigError) as refused:
        validate_config(config)
    assert [line.split(":")[0] for line in str(refused.value).splitlines()] == ["grpo.loss_type", "grpo.temperature"]
    assert config.grpo.loss_type == "dapoo"  # (the config itself is left as it was)


def test_a_config_file_that_fails_as_a_whole_is_its_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             ) -> None:
    """A missing or unreadable TOML file is one line: the rules between values are not judged on
    the defaults its values would have replaced (a total_steps below the default steps, here)."""
    from torchtitan_lite.train import main

    assert main(["--job.config_file", str(tmp_path / "nope.toml"), "--lr_scheduler.total_steps", "5"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"error: job.config_file: file not found: {str(tmp_path / 'nope.toml')!r}"], lines


def test_help_says_which_sources_on_bad_row_covers() -> None:
    """``training.on_bad_row`` covers every row source and names the line that is not JSON."""
    from torchtitan_lite.config import format_help

    text = " ".join(format_help().split())
    assert "For chat, preference and prompts data (and grpo.rollouts_path): a row that cannot be used (a line that " \
           "is not JSON" in text
