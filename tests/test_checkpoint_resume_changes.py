"""Resuming with a changed config: the changes are listed, schedule settings take effect from the
resumed step, settings a resumed run cannot change are refused, and a finished run says that
there is nothing left to train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed


def _train(argv: list[str]) -> dict[str, Any]:
    import logging

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import UserError
    from torchtitan_lite.trainer import Trainer

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("torchtitan_lite")
    logger.addHandler(handler)
    try:
        trainer = Trainer(load_job_config(argv))
    except UserError as exc:
        return {"error": str(exc), "warnings": messages}
    finally:
        logger.removeHandler(handler)
    logger.addHandler(handler)
    try:
        history = trainer.train()
    finally:
        logger.removeHandler(handler)
        trainer.close()
    return {"error": None, "warnings": messages, "lr": {h["step"]: h["lr"] for h in history}}


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--checkpoint.enable", "--checkpoint.interval", "2",
            "--lr_scheduler.warmup_steps", "2", *extra]


def test_resume_lists_changes_and_the_new_schedule_applies_from_the_resumed_step(tmp_path: Path) -> None:
    dump = tmp_path / "job"
    first = run_distributed(_train, 1, _argv(dump, "--training.steps", "4"))[0]
    assert first["error"] is None
    saved = json.loads((dump / "checkpoint" / "step-4" / "train_state.json").read_text())["config"]
    assert saved["optimizer.lr"] == 3e-3 and saved["training.steps"] == 4

    resumed = run_distributed(_train, 1, _argv(dump, "--training.steps", "8", "--optimizer.lr", "1e-5"))[0]
    assert resumed["error"] is None
    changes = [m for m in resumed["warnings"] if m.startswith("resuming ")]
    assert len(changes) == 1 and changes[0].endswith(
        "with changed settings (they apply from step 4 on): optimizer.lr 0.003 -> 1e-05; training.steps 4 -> 8")
    # The lr of steps 5-8 is that of a run configured so from the start.
    fresh = run_distributed(_train, 1, _argv(tmp_path / "fresh", "--training.steps", "8", "--optimizer.lr", "1e-5"))[0]
    assert [resumed["lr"][s] for s in range(5, 9)] == [fresh["lr"][s] for s in range(5, 9)]
    assert max(resumed["lr"].values()) <= 1e-5

    # A finished run resumed again says so and trains nothing.
    again = run_distributed(_train, 1, _argv(dump, "--training.steps", "8", "--optimizer.lr", "1e-5"))[0]
    assert again["lr"] == {}
    assert any(m.startswith("nothing to train: the run is at step 8 and training.steps = 8") for m in again["warnings"])


@pytest.mark.slow
def test_a_resumed_run_cannot_change_its_tokenizer(tmp_path: Path) -> None:
    from tests.data_helpers import train_hf_tokenizer

    dump = tmp_path / "job"
    assert run_distributed(_train, 1, _argv(dump, "--training.steps", "2"))[0]["error"] is None
    tokenizer = train_hf_tokenizer(tmp_path / "tok", vocab=258)
    refused = run_distributed(_train, 1, _argv(dump, "--training.steps", "4", "--model.tokenizer_path",
                                                   str(tokenizer)))[0]
    assert refused["error"] == (
        f"model.tokenizer_path: invalid value {str(tokenizer)!r}; {str(dump / 'checkpoint' / 'step-2')!r} was "
        "trained with None, and a resumed run cannot change it (start a new run from it with "
        "checkpoint.initial_load_path instead)")
