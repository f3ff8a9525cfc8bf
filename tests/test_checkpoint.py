"""Checkpoints: exact resume after a crash, atomic commits, keep_latest_k, safe loading."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from torchtitan_lite.checkpoint import committed_steps


def _train(argv: list[str], crash_at: int | None = None) -> dict[str, Any]:
    """Train with ``argv``; with ``crash_at``, raise inside that step (a crash mid-run)."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.train import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    if crash_at is not None:
        original = trainer.train_step

        def crashing() -> dict[str, float]:
            if trainer.step + 1 == crash_at:
                raise RuntimeError("injected crash")
            return original()

        trainer.train_step = crashing  # type: ignore[method-assign]
    history: list[dict[str, float]] = []
    try:
        history = trainer.train()
        outcome = "finished"
    except RuntimeError as exc:
        outcome = str(exc)
    finally:
        trainer.close(clean=crash_at is None)
    return {"start": start, "history": history, "outcome": outcome}


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "10",
            "--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5",
            *extra]


def test_resume_after_a_crash_is_bit_identical(tmp_path):
    (full,) = run_distributed(_train, 1, _argv(tmp_path / "full"))
    # Two ranks would work the same; one keeps the test fast and the comparison bitwise.
    (crashed,) = run_distributed(_train, 1, _argv(tmp_path / "split"), 7)
    assert crashed["outcome"] == "injected crash"
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5]
    (resumed,) = run_distributed(_train, 1, _argv(tmp_path / "split"))
    assert resumed["start"] == 5
    assert [h["step"] for h in resumed["history"]] == list(range(6, 11))
    expected = [h["loss"] for h in full["history"][5:]]
    got = [h["loss"] for h in resumed["history"]]
    assert got == expected, (got, expected)  # bit-identical, not approximately equal
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in full["history"][5:]]
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5, 10]


def test_keep_latest_k_and_two_rank_resume(tmp_path):
    dump = tmp_path / "run"
    run_distributed(_train, 2, _argv(dump, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"))
    folder = dump / "checkpoint"
    assert committed_steps(folder) == [8, 10]
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-8"]  # nothing partial left
    # Resume an explicit earlier step on 2 ranks: training continues from step 8.
    results = run_distributed(_train, 2, _argv(dump, "--checkpoint.load_step", "8",
                                               "--checkpoint.keep_latest_k", "2"))
    assert results[0]["start"] == 8 and [h["step"] for h in results[0]["history"]] == [9, 10]


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    """DCP metadata is a pickle; loading refuses anything but DCP's own classes."""
    import io

    from torchtitan_lite.checkpoint import _MetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


def test_checkpoint_of_another_shape_is_one_clear_error(tmp_path):
    import sys

    from tests.dist_utils import run_command

    dump = tmp_path / "run"
    base = [sys.executable, "-m", "torchtitan_lite.train", *_argv(dump, "--training.steps", "2")]
    assert run_command(base, timeout=120).returncode == 0
    assert committed_steps(dump / "checkpoint") == [2]
    # The same folder with a larger vocabulary: embedding shapes differ; never trains from scratch.
    bad = run_command([*base, "--model.vocab_size", "300", "--training.steps", "4"], timeout=120)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2, bad.stderr
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint "), bad.stderr
    assert "step-2" in lines[0]
    missing = run_command([*base, "--checkpoint.load_step", "7"], timeout=120)
    assert missing.returncode == 2 and "checkpoint.load_step: invalid value 7" in missing.stderr
