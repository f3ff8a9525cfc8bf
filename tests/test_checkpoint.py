"""Checkpoints: exact resume after a crash, atomic commits, keep_latest_k, safe loading."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from torchtitan_lite.checkpoint import committed_steps


def _train(argv: list[str], crash_at: int | None = None) -> dict[str, Any]:
    """Train with ``argv``; with ``crash_at``, raise inside that step (a crash mid-run).

    Each step also records the windows this rank read and one draw from the global RNG (the
    model uses none, so the draw shows whether a resume restored the generator)."""
    import torch

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.train import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    original = trainer.train_step
    samples: dict[int, list[int]] = {}
    draws: list[int] = []

    def recording_step() -> dict[str, float]:
        if crash_at is not None and trainer.step + 1 == crash_at:
            raise RuntimeError("injected crash")
        samples[trainer.step + 1] = trainer.loader.sample_indices(trainer.loader.step)
        values = original()
        draws.append(int(torch.randint(0, 2**62, ())))
        return values

    trainer.train_step = recording_step  # type: ignore[method-assign]
    history: list[dict[str, float]] = []
    try:
        history = trainer.train()
        outcome = "finished"
    except RuntimeError as exc:
        outcome = str(exc)
    finally:
        trainer.close(clean=crash_at is None)
    return {"start": start, "history": history, "outcome": outcome, "samples": samples, "draws": draws,
            "blocked_s": None if trainer.checkpointer is None else trainer.checkpointer.last_blocked_s}


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "10",
            "--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5",
            *extra]


def _losses(result: dict[str, Any], first: int) -> list[float]:
    return [h["loss"] for h in result["history"] if h["step"] >= first]


def _global_samples(results: list[dict[str, Any]], steps: range) -> dict[int, list[int]]:
    """Per step, every window read by any rank (sorted): the global batch."""
    return {s: sorted(i for r in results for i in r["samples"][s]) for s in steps}


def test_resume_after_a_crash_is_bit_identical(tmp_path):
    (full,) = run_distributed(_train, 1, _argv(tmp_path / "full"))
    # Two ranks would work the same; one keeps the test fast and the comparison bitwise.
    (crashed,) = run_distributed(_train, 1, _argv(tmp_path / "split"), 7)
    assert crashed["outcome"] == "injected crash"
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5]
    (resumed,) = run_distributed(_train, 1, _argv(tmp_path / "split"))
    assert resumed["start"] == 5
    assert [h["step"] for h in resumed["history"]] == list(range(6, 11))
    expected = _losses(full, 6)
    got = _losses(resumed, 6)
    assert got == expected, (got, expected)  # bit-identical, not approximately equal
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in full["history"][5:]]
    # The RNG continues where it stopped (without restoring it, step 6 would repeat step 1's draw).
    assert resumed["draws"] == full["draws"][5:]
    assert {s: resumed["samples"][s] for s in range(6, 11)} == {s: full["samples"][s] for s in range(6, 11)}
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5, 10]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """10 steps on 2 ranks with checkpoints at 5 and 10: (dump folder, per-rank results)."""
    dump = tmp_path_factory.mktemp("two_rank")
    return dump, run_distributed(_train, 2, _argv(dump))


@pytest.mark.parametrize("world,extra", [
    (1, []),
    (4, ["--training.local_batch_size", "1"]),
    (4, ["--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2"]),
], ids=["fsdp1", "fsdp4", "hsdp2x2"])
def test_resume_at_another_world_size(tmp_path, two_rank_run, world, extra):
    """Saved on 2 ranks, resumed on 1, 4 (FSDP) or 2 × 2 (HSDP): the losses continue those of the
    2-rank run and the global batches of steps 6-10 are exactly the ones it read."""
    base, two = two_rank_run
    resumed_dump = tmp_path / "resumed"
    shutil.copytree(base / "checkpoint" / "step-5", resumed_dump / "checkpoint" / "step-5")
    results = run_distributed(_train, world, _argv(resumed_dump, *extra))
    assert all(r["start"] == 5 for r in results)
    expected, got = _losses(two[0], 6), _losses(results[0], 6)
    assert len(got) == 5
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5 * abs(e), (got, expected)
    steps = range(6, 11)
    assert _global_samples(results, steps) == _global_samples(two, steps)  # none skipped or repeated


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
