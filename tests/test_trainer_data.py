"""Data through the trainer (``torchtitan_lite/data/build.py``'s ``build_data``): Meta's tiktoken
``tokenizer.model`` with Parquet files trains, validates and exports its tokenizer; an exact resume
in the middle of a Parquet dataset on 2 ranks and at another world size; a Hugging Face
``datasets`` folder trains; a mixture of three source kinds keeps its shares, reports each
source's tokens and loss and each validation set's loss, and resumes exactly on 1 and 4 ranks."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.test_data_arrow import write_parquet
from tests.test_data_tiktoken import SAMPLES, small_ranks, stdlib_docs, write_tiktoken_model
from torchtitan_lite.data import build_tokenizer
from torchtitan_lite.data.arrow import ArrowCorpus


def _train(argv: list[str]) -> dict[str, Any]:
    """Train with ``argv``; records a digest of the windows each rank read at each step."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    original = trainer.loader.next_batch
    digests: dict[int, list[str]] = {}  # step -> a digest of each window this rank read, in order

    def recording() -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = original()
        rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro])
        digests[trainer.step + 1] = [hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in rows]
        return micro

    trainer.loader.next_batch = recording
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return {"start": start, "history": history, "digests": digests, "rank": trainer.rank,
            "reader": type(trainer.loader.sources[0].reader).__name__}


def _losses(result: dict[str, Any], first: int = 1) -> list[float]:
    return [h["loss"] for h in result["history"] if h["step"] >= first]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiktoken tokenizer.model and a Parquet folder (two files) of real text."""
    root = tmp_path_factory.mktemp("assets")
    write_tiktoken_model(root / "tokenizer" / "tokenizer.model", small_ranks())
    docs = stdlib_docs(120)
    write_parquet(root / "parquet" / "part-0.parquet", docs[:70], row_group_size=8)
    write_parquet(root / "parquet" / "part-1.parquet", docs[70:100], row_group_size=8)
    write_parquet(root / "val" / "val.parquet", docs[100:], row_group_size=8)
    return root


def _argv(dump: Path, assets: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--model.tokenizer_path", str(assets / "tokenizer"),
            "--training.dataset", "parquet", "--training.dataset_path", str(assets / "parquet"),
            "--training.global_batch_size", "4", *extra]


@pytest.mark.slow
def test_tiktoken_and_parquet_train_and_validate(tmp_path: Path, assets: Path) -> None:
    """Meta's tokenizer format and a streamed Parquet dataset through the trainer: the loss starts
    near uniform over the vocabulary and falls; validation on a Parquet set is finite."""
    argv = _argv(tmp_path, assets, "--training.steps", "16", "--training.local_batch_size", "4",
                 "--optimizer.lr", "1e-2", "--validation.enable", "--validation.dataset", "parquet",
                 "--validation.dataset_path", str(assets / "val"), "--validation.freq", "16",
                 "--validation.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "100",
                 "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf")
    (result,) = run_distributed(_train, 1, argv)
    assert result["reader"] == "LaneReader"
    losses = _losses(result)
    vocab = build_tokenizer(str(assets / "tokenizer")).vocab_size
    assert all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(vocab)) < 1.0, losses
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses
    validation = [h for h in result["history"] if "validation_loss" in h]
    assert len(validation) == 1 and math.isfinite(validation[0]["validation_loss"])
    assert validation[0]["validation_tokens"] == 2 * 4 * 32  # validation.steps × global batch × seq_len
    # The Hugging Face export holds the tokenizer.model written as a tokenizer.json (what
    # transformers' TikTokenConverter writes), with the same ids for plain text.
    transformers = pytest.importorskip("transformers")
    export = tmp_path / "checkpoint" / "step-16"
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    tok = build_tokenizer(str(assets / "tokenizer"))
    assert (hf.bos_token, hf.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)
    for text in [s for s in SAMPLES if "<|" not in s] + stdlib_docs(10):
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, bos=False, eos=False)


@pytest.mark.slow
def test_resume_mid_parquet_is_exact_on_two_ranks_and_one(tmp_path: Path, assets: Path) -> None:
    """8 steps on 2 ranks with checkpoints at 4 and 8; resumed from step 4 on 2 ranks the losses
    of steps 5-8 are bit-identical and every rank reads the same windows; resumed on 1 rank (the
    same global batch of 4), the global batches are the same and the losses equal to 1e-5."""
    extra = ("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4")
    full = run_distributed(_train, 2, _argv(tmp_path / "full", assets, *extra))
    assert _losses(full[0]) == _losses(full[1]) and len(_losses(full[0])) == 8
    for world, more in [(2, ()), (1, ("--training.local_batch_size", "4"))]:
        dump = tmp_path / f"resumed_{world}"
        shutil.copytree(tmp_path / "full" / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        resumed = run_distributed(_train, world, _argv(dump, assets, *extra, *more))
        assert all(r["start"] == 4 for r in resumed)
        expected, got = _losses(full[0], 5), _losses(resumed[0], 5)
        assert len(got) == 4
        if world == 2:
            assert got == expected, (got, expected)  # bit-identical
            for rank in range(2):
                assert resumed[rank]["digests"] == {s: full[rank]["digests"][s] for s in range(5, 9)}
        else:  # the one rank reads rank 0's windows, then rank 1's, of each global batch
            assert resumed[0]["digests"] == {s: full[0]["digests"][s] + full[1]["digests"][s] for s in range(5, 9)}
            for g, e in zip(got, expected, strict=True):
                assert abs(g - e) <= 1e-5 * abs(e), (got, expected)


def test_datasets_save_to_disk_folder_trains(tmp_path: Path) -> None:
    """A Hugging Face datasets folder (save_to_disk: Arrow shards, dataset_info.json, state.json)
    with its text in another column trains, and validates on the same folder."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    docs = stdlib_docs(40)
    datasets.Dataset.from_dict({"content": docs, "n": list(range(len(docs)))}).save_to_disk(
        str(folder), max_shard_size="20KB")
    assert len(list(folder.glob("*.arrow"))) > 1 and (folder / "state.json").is_file()
    corpus = ArrowCorpus("arrow", str(folder), text_column="content")
    assert list(corpus.texts(0, corpus.num_rows)) == docs
    argv = [*TINY_ARGS, "--job.dump_folder", str(tmp_path / "out"), "--training.dataset", "arrow",
            "--training.dataset_path", str(folder), "--training.dataset_text_column", "content",
            "--validation.enable", "--validation.dataset", "arrow", "--validation.dataset_path", str(folder),
            "--validation.freq", "4", "--validation.steps", "1"]
    (result,) = run_distributed(_train, 1, argv)
    losses = _losses(result)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(258)) < 1.0  # the byte tokenizer
    assert math.isfinite(result["history"][-1]["validation_loss"])


# --------------------------------------------------------------------------------------------
# A mixture of three source kinds through the trainer
# --------------------------------------------------------------------------------------------

MIX_WEIGHTS = {"code": 0.5, "web": 0.3, "books": 0.2}
MIX_SEQ = 32
MIX_GLOBAL = 4


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TOML job reading a token file (code), a Parquet folder (web) and a text folder (books)
    at 0.5 / 0.3 / 0.2, validated on two named sets; checkpoints every 20 steps."""
    import numpy as np

    from torchtitan_lite.data import ByteTokenizer

    root = tmp_path_factory.mktemp("mixture")
    docs = stdlib_docs(90, chars=800)
    np.save(root / "code.npy", np.concatenate(ByteTokenizer().encode_batch(docs[:30])).astype(np.uint16))
    write_parquet(root / "web" / "a.parquet", docs[30:45], row_group_size=4)
    write_parquet(root / "web" / "b.parquet", docs[45:60], row_group_size=4)
    (root / "books").mkdir()
    (root / "books" / "one.txt").write_text(docs[60])
    (root / "books" / "more.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[61:80]))
    write_parquet(root / "val_web.parquet", docs[80:90], row_group_size=4)
    paths = {"code": ("tokens", root / "code.npy"), "web": ("parquet", root / "web"),
             "books": ("text", root / "books")}
    tables = "".join(f'[[training.datasets]]\nname = "{name}"\ndataset = "{kind}"\ndataset_path = "{path}"\n'
                     f"weight = {MIX_WEIGHTS[name]}\n\n" for name, (kind, path) in paths.items())
    (root / "job.toml").write_text(
        f"[training]\nsteps = 40\nseq_len = {MIX_SEQ}\nglobal_batch_size = {MIX_GLOBAL}\nlocal_batch_size = 1\n\n"
        f"{tables}[validation]\nenable = true\nfreq = 20\nsteps = 2\n\n"
        f'[[validation.datasets]]\nname = "held_out_web"\ndataset = "parquet"\n'
        f'dataset_path = "{root / "val_web.parquet"}"\n\n'
        '[[validation.datasets]]\nname = "stdlib"\ndataset = "python_stdlib_validation"\n\n'
        "[checkpoint]\nenable = true\ninterval = 20\n\n[metrics]\nenable_tensorboard = true\n"
    )
    return root


def _mixture_argv(root: Path, dump: Path) -> list[str]:
    tiny = list(TINY_ARGS)
    for key in ("--training.seq_len", "--training.local_batch_size", "--training.steps"):  # the TOML's
        del tiny[tiny.index(key) : tiny.index(key) + 2]
    return ["--job.config_file", str(root / "job.toml"), *tiny, "--job.dump_folder", str(dump)]


@pytest.mark.slow
def test_mixture_shares_losses_and_validation_sets(tmp_path: Path, mixture: Path) -> None:
    """A token file, a Parquet folder and a text folder at 0.5 / 0.3 / 0.2 on 2 ranks for 40
    steps: at every step each tokens/NAME in metrics.jsonl is within one sample (seq_len tokens)
    of its weight's share of all training tokens so far, and the loss/NAME, weighted by each
    source's tokens of the step, make up the step's loss. Each named validation set has its
    loss and perplexity in metrics.jsonl and TensorBoard. Resumed from step 20 on 1 rank and on
    4 ranks (the same global batch), steps 21-40 read the same windows (every window's digest)
    and their losses, overall and per source, equal the 2-rank run's within 1e-5."""
    full = run_distributed(_train, 2, _mixture_argv(mixture, tmp_path / "full"))
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    previous = dict.fromkeys(MIX_WEIGHTS, 0.0)
    for r in records:
        total = r["step"] * MIX_GLOBAL * MIX_SEQ
        assert sum(r[f"tokens/{name}"] for name in MIX_WEIGHTS) == total == r["tokens_seen"]
        for name, weight in MIX_WEIGHTS.items():
            assert abs(r[f"tokens/{name}"] - weight * total) <= MIX_SEQ, (r["step"], name, r[f"tokens/{name}"])
        step_tokens = {name: r[f"tokens/{name}"] - previous[name] for name in MIX_WEIGHTS}
        mixed = sum(r[f"loss/{name}"] * n for name, n in step_tokens.items() if n) / (MIX_GLOBAL * MIX_SEQ)
        assert abs(mixed - r["loss"]) <= 1e-9 * r["loss"], (r["step"], mixed, r["loss"])
        assert all((r[f"loss/{name}"] is None) == (n == 0) for name, n in step_tokens.items())
        previous = {name: r[f"tokens/{name}"] for name in MIX_WEIGHTS}
    validated = [r for r in records if r.get("validation/stdlib/loss") is not None]
    assert [r["step"] for r in validated] == [20, 40]
    for r in validated:
        for name in ("held_out_web", "stdlib"):
            assert math.isfinite(r[f"validation/{name}/loss"])
            assert abs(r[f"validation/{name}/perplexity"] - math.exp(r[f"validation/{name}/loss"])) < 1e-6 * \
                r[f"validation/{name}/perplexity"]
        assert r["validation/held_out_web/loss"] != r["validation/stdlib/loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "full" / "tb").iterdir()
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    for name in ("held_out_web", "stdlib"):
        events = acc.Scalars(f"validation/{name}/loss")
        assert [(e.step, round(e.value, 5)) for e in events] == [
            (r["step"], round(r[f"validation/{name}/loss"], 5)) for r in validated]
    assert [e.step for e in acc.Scalars("tokens/web")] == list(range(1, 41))

    expected = {h["step"]: h for h in full[0]["history"]}
    for world in (1, 4):
        dump = tmp_path / f"resumed_{world}"
        shutil.copytree(tmp_path / "full" / "checkpoint" / "step-20", dump / "checkpoint" / "step-20")
        resumed = run_distributed(_train, world, _mixture_argv(mixture, dump))
        assert all(r["start"] == 20 for r in resumed)
        for step in range(21, 41):
            windows = [d for r in resumed for d in r["digests"][step]]
            assert windows == full[0]["digests"][step] + full[1]["digests"][step], (world, step)
        got = {h["step"]: h for h in resumed[0]["history"]}
        assert sorted(got) == list(range(21, 41))
        for step, h in got.items():
            for key in ["loss", *(f"loss/{name}" for name in MIX_WEIGHTS)]:
                e = expected[step][key]
                assert (h[key] is None) == (e is None) and (e is None or abs(h[key] - e) <= 1e-5 * abs(e)), \
                    (world, step, key, h[key], e)
            assert all(h[f"tokens/{n}"] == expected[step][f"tokens/{n}"] for n in MIX_WEIGHTS)
