"""The loop's callbacks (``torchtitan_lite/callbacks/``): one of your own sees every step; Weights
& Biases receives the records ``metrics.jsonl`` has (offline, read back from the run's file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import read_jsonl, run_distributed


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
    then LevelDB log records (CRC, length, type; a record split over 32 KiB blocks as
    first/middle/last parts)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _train_with_wandb(argv: list[str], folder: str) -> list[float]:
    import os

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=folder)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        return [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()


def test_wandb_offline_run_holds_the_losses_of_metrics_jsonl(tmp_path: Path) -> None:
    """``metrics.enable_wandb`` in offline mode: the run's file, read back, has one history row per
    record of metrics.jsonl, with the same step, loss, learning rate and validation loss; the
    run's config is the job's."""
    pytest.importorskip("wandb")
    dump = tmp_path / "run"
    argv = [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "6", "--metrics.log_freq", "2",
            "--metrics.enable_wandb", "--metrics.wandb_project", "tests", "--metrics.wandb_run_name", "tiny",
            "--validation.enable", "--validation.freq", "3", "--validation.steps", "1"]
    (losses,) = run_distributed(_train_with_wandb, 1, argv, str(tmp_path))
    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 6]
    (file,) = (dump / "wandb").glob("offline-run-*/run-*.wandb")
    history = {}
    config = {}
    for record in _wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[int(record.history.step.num)] = items
        elif kind == "run":
            assert record.run.display_name == "tiny" and record.run.project == "tests"
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        row = history[r["step"]]
        assert row["loss"] == r["loss"] and row["lr"] == r["lr"] and row["grad_norm"] == r["grad_norm"], (row, r)
        assert row.get("validation_loss") == r["validation_loss"]
    assert [history[s]["loss"] for s in (1, 2, 4, 6)] == [losses[s - 1] for s in (1, 2, 4, 6)]
    assert config["training"]["steps"] == 6 and config["metrics"]["enable_wandb"] is True


class _Recorder:
    """A callback of a user's: what it saw."""

    def __init__(self) -> None:
        from torchtitan_lite.callbacks import Callback

        class Recorder(Callback):
            def __init__(self) -> None:
                self.seen: list[Any] = []

            def on_train_start(self, trainer: Any) -> None:
                self.seen.append(("start", trainer.step))

            def after_step(self, trainer: Any, state: Any) -> None:
                self.seen.append(("step", state.step, state.logged, "loss" in state.values))

            def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
                self.seen.append(("record", step, record["loss"]))

            def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
                self.seen.append(("end", error is None))

        self.callback = Recorder()


def _train_with_recorder(argv: list[str]) -> list[Any]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    recorder = _Recorder().callback
    trainer.callbacks.append(recorder)
    try:
        trainer.train()
    finally:
        trainer.close()
    return recorder.seen


def test_a_callback_of_ones_own_sees_every_step_after_the_built_in_ones(tmp_path: Path) -> None:
    (seen,) = run_distributed(_train_with_recorder, 1, [*TINY_ARGS, "--job.dump_folder", str(tmp_path),
                                                         "--training.steps", "3", "--metrics.log_freq", "2"])
    assert seen[0] == ("start", 0) and seen[-1] == ("end", True)
    # Records at step 1 (the first), 2 (log_freq) and 3 (the last), each before the user's callback runs.
    steps = [s for s in seen if s[0] == "step"]
    assert steps == [("step", 1, True, True), ("step", 2, True, True), ("step", 3, True, True)]
    assert [s[1] for s in seen if s[0] == "record"] == [1, 2, 3]
    assert seen.index(("step", 1, True, True)) > seen.index(next(s for s in seen if s[0] == "record"))


def test_wandb_without_the_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from torchtitan_lite.callbacks.wandb import check_wandb
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        check_wandb(load_job_config(["--metrics.enable_wandb"]))
    assert str(info.value) == ("metrics.enable_wandb: invalid value True; the wandb package is not installed "
                               "(pip install 'torchtitan_lite[wandb]', or pip install wandb)")
