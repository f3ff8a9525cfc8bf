"""Divergence: a non-finite loss or gradient norm never updates the weights, never reaches a
checkpoint, and ``training.on_nonfinite`` decides what follows (stop, skip, rollback).

The runs are 2 gloo ranks on the tiny model. A real divergence (``--optimizer.lr 1e3``) shows
the default; an injected one (the loss of one chosen global batch made NaN on every rank) shows
skip and rollback against the same run without it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed

BAD_BATCH = 6  # the global batch (0-based) whose loss is made NaN: training step 7


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "10", "--checkpoint.enable",
            "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "2", *extra]


def _main(argv: list[str]) -> tuple[int, str]:
    """``python -m torchtitan_lite.train`` in this rank: exit code and stderr."""
    from torchtitan_lite.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _run(argv: list[str], poison: bool) -> dict[str, Any]:
    """The trainer with (``poison``) the loss of global batch BAD_BATCH made NaN."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import TrainingError
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    loss_fn = trainer.objective.loss_fn

    def poisoned(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, labels)
        return loss * float("nan") if trainer.loader.step - 1 == BAD_BATCH else loss

    if poison:
        trainer.objective.loss_fn = poisoned
    out: dict[str, Any] = {"error": None}
    try:
        out["history"] = trainer.train()
    except TrainingError as exc:
        out["error"] = str(exc)
    out["step"], out["skipped_batches"] = trainer.step, sorted(trainer.loader.skipped)
    trainer.close(clean=out["error"] is None)
    return out


def _strict_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics file read as strict JSON (no NaN or Infinity literals)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}: not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _finite_checkpoints(folder: Path) -> list[int]:
    """The committed steps of ``folder``, each checked to hold only finite weights."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.checkpoint.manager import committed_steps
    from torchtitan_lite.checkpoint.safe_reading import SafeFileSystemReader
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, Transformer

    steps = committed_steps(folder)
    for step in steps:
        state = {"model": Transformer(LLAMA3_FLAVORS["tiny"]).state_dict()}
        with warnings.catch_warnings():  # no process group here on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(folder / f"step-{step}")))
        for name, tensor in state["model"].items():
            assert torch.isfinite(tensor).all(), (step, name)
    return steps


@pytest.mark.slow
def test_lr_1e3_stops_with_one_line_and_leaves_only_finite_checkpoints(tmp_path: Path) -> None:
    dump = tmp_path / "job"
    # A save after every step, the latest 2 kept: what is on disk when it stops must be finite.
    ranks = run_distributed(_main, 2, _argv(dump, "--training.steps", "20", "--optimizer.lr", "1e3",
                                            "--checkpoint.interval", "1"))
    code, err = ranks[0]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 5 and ranks[1][0] == 5, ranks
    assert len(lines) == 1 and lines[0].startswith("error: training diverged at step "), lines
    step = int(lines[0].split("step ")[1].split(":")[0])
    assert "is not finite; the update was not applied" in lines[0]
    assert "training.on_nonfinite = 'skip' or 'rollback'" in lines[0]
    records = _strict_jsonl(dump / "metrics.jsonl")
    assert records[-1]["step"] == step and records[-1]["skipped"] == 1.0
    assert records[-1]["loss"] is None or records[-1]["grad_norm"] is None
    assert all(r["step"] < step and r["skipped"] == 0.0 for r in records[:-1])
    kept = _finite_checkpoints(dump / "checkpoint")
    assert kept == [step - 2, step - 1], (kept, step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The same 10-step job: clean, and poisoned with each of stop, skip and rollback."""
    out = {}
    for name, poison, extra in (("clean", False, []), ("stop", True, []),
                                ("skip", True, ["--training.on_nonfinite", "skip"]),
                                ("rollback", True, ["--training.on_nonfinite", "rollback"])):
        dump = tmp_path_factory.mktemp(name)
        out[name] = (dump, run_distributed(_run, 2, _argv(dump, *extra), poison)[0])
    return out


def _losses(dump: Path) -> dict[int, float | None]:
    """The last logged loss of each step (a rolled-back run logs replayed steps again)."""
    return {r["step"]: r["loss"] for r in _strict_jsonl(dump / "metrics.jsonl")}


@pytest.mark.slow
def test_stop_names_the_step_and_keeps_the_checkpoint_before_it(runs) -> None:
    dump, stop = runs["stop"]
    assert stop["error"].startswith(f"training diverged at step {BAD_BATCH + 1}: the loss (nan)")
    assert f"the checkpoints in {str(dump / 'checkpoint')!r} (steps [4]) are from finite steps" in stop["error"]
    assert _finite_checkpoints(dump / "checkpoint") == [4]
    clean = _losses(runs["clean"][0])
    losses = _losses(dump)
    assert losses[BAD_BATCH + 1] is None
    assert [losses[s] for s in range(1, BAD_BATCH + 1)] == [clean[s] for s in range(1, BAD_BATCH + 1)]


@pytest.mark.slow
def test_skip_goes_on_without_the_update(runs) -> None:
    dump, skip = runs["skip"]
    assert skip["error"] is None and skip["step"] == 10
    records = _strict_jsonl(dump / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [1.0 if r["step"] == BAD_BATCH + 1 else 0.0 for r in records]
    losses, clean = _losses(dump), _losses(runs["clean"][0])
    assert losses[BAD_BATCH + 1] is None
    assert all(math.isfinite(losses[s]) for s in range(1, 11) if s != BAD_BATCH + 1)
    # Up to the bad step the run is the clean one; after it, the weights lack one update.
    assert [losses[s] for s in range(1, BAD_BATCH + 1)] == [clean[s] for s in range(1, BAD_BATCH + 1)]
    assert losses[BAD_BATCH + 2] != clean[BAD_BATCH + 2]
    assert _finite_checkpoints(dump / "checkpoint") == [8, 10]


@pytest.mark.slow
def test_rollback_reloads_the_last_checkpoint_and_leaves_the_batch_out(runs) -> None:
    dump, rollback = runs["rollback"]
    assert rollback["error"] is None and rollback["step"] == 10
    assert rollback["skipped_batches"] == [BAD_BATCH]
    records = _strict_jsonl(dump / "metrics.jsonl")
    steps = [r["step"] for r in records]
    # 1..7 (7 diverged), back to the checkpoint at 4, then 5..10 again.
    assert steps == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10], steps
    assert [r["skipped"] for r in records].count(1.0) == 1
    clean = _losses(runs["clean"][0])
    replayed = records[7:]
    # The replayed steps 5 and 6 are bitwise those of the clean run (same state, same batches);
    # from step 7 on the run reads batch 7 where the clean one read batch 6.
    assert [r["loss"] for r in replayed[:2]] == [clean[5], clean[6]]
    assert all(math.isfinite(r["loss"]) for r in replayed) and replayed[2]["loss"] != clean[7]
    assert _finite_checkpoints(dump / "checkpoint") == [8, 10]
    train_state = json.loads((dump / "checkpoint" / "step-10" / "train_state.json").read_text())
    assert train_state["dataloader"]["skipped"] == [BAD_BATCH]
