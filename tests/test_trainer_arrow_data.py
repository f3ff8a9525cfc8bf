"""Streamed datasets (``torchtitan_lite/arrow_data.py``) through the trainer: Meta's tiktoken
``tokenizer.model`` with Parquet files trains, validates and exports its tokenizer; an exact resume
in the middle of a Parquet dataset on 2 ranks and at another world size; a Hugging Face
``datasets`` folder trains."""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.test_arrow_data import write_parquet
from tests.test_data_tiktoken import SAMPLES, small_ranks, stdlib_docs, write_tiktoken_model
from torchtitan_lite.arrow_data import ArrowCorpus
from torchtitan_lite.data import build_tokenizer


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

    trainer.loader.next_batch = recording  # type: ignore[method-assign]
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return {"start": start, "history": history, "digests": digests, "rank": trainer.rank,
            "loader": type(trainer.loader).__name__}


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


def test_tiktoken_and_parquet_train_and_validate(tmp_path: Path, assets: Path) -> None:
    """Meta's tokenizer format and a streamed Parquet dataset through the trainer: the loss starts
    near uniform over the vocabulary and falls; validation on a Parquet set is finite."""
    argv = _argv(tmp_path, assets, "--training.steps", "16", "--training.local_batch_size", "4",
                 "--optimizer.lr", "1e-2", "--validation.enable", "--validation.dataset", "parquet",
                 "--validation.dataset_path", str(assets / "val"), "--validation.freq", "16",
                 "--validation.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "100",
                 "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf")
    (result,) = run_distributed(_train, 1, argv)
    assert result["loader"] == "StreamingLoader"
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
