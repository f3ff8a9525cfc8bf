"""Saves that cannot succeed: a checkpoint folder that is a file, or on a read-only mount, is found
before training; a full
disk during a save is one line naming the cause, the partial folder is removed and the earlier
checkpoints stay intact (sync and async)."""

from __future__ import annotations

import contextlib
import errno
import io
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from tests.test_trainer_divergence import _finite_checkpoints


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path: Path) -> None:
    from torchtitan_lite.train import main

    dump = tmp_path / "job"
    dump.mkdir()
    (dump / "checkpoint").write_text("not a folder")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([*TINY_ARGS, "--job.dump_folder", str(dump), "--checkpoint.enable"])
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code == 2 and lines == [
        f"error: checkpoint.folder: invalid value {str(dump / 'checkpoint')!r}; "
        f"{str(dump / 'checkpoint')!r} exists and is not a folder"], lines
    assert not (dump / "metrics.jsonl").exists()


@pytest.fixture
def read_only_mount(tmp_path: Path):
    """A read-only tmpfs holding an empty folder ``ckpt`` (skipped where mounting is not allowed)."""
    import subprocess

    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        (mnt / "ckpt").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_checkpoint_folder_on_a_read_only_mount_is_refused_before_training(tmp_path: Path,
                                                                            read_only_mount: Path) -> None:
    """A real read-only file system (not a permission bit, which root ignores): one line before
    any process group, for the checkpoint folder and for the dump folder."""
    from torchtitan_lite.train import main

    for args, line in [
        (["--job.dump_folder", str(tmp_path / "job"), "--checkpoint.enable", "--checkpoint.folder",
          str(read_only_mount / "ckpt")],
         f"error: checkpoint.folder: invalid value {str(read_only_mount / 'ckpt')!r}; "
         f"{str(read_only_mount / 'ckpt')!r} is not writable"),
        (["--job.dump_folder", str(read_only_mount / "job")],
         f"error: job.dump_folder: invalid value {str(read_only_mount / 'job')!r}; "
         f"{str(read_only_mount)!r} is not writable"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main([*TINY_ARGS, *args])
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        assert code == 2 and lines == [line], lines
    assert not (tmp_path / "job" / "metrics.jsonl").exists()


def _disk_full_at_step_4(dump: str, mode: str) -> dict[str, Any]:
    """The trainer with saves every 2 steps, where rank 1's files of step 4 cannot be written
    (ENOSPC, as on a full disk)."""
    import os

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import CheckpointError
    from torchtitan_lite.trainer import Trainer

    original = FileSystemWriter.write_data

    def full_disk(self: Any, plan: Any, planner: Any) -> Any:
        if os.environ["RANK"] == "1" and ".step-4.partial" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return original(self, plan, planner)

    FileSystemWriter.write_data = full_disk
    try:
        trainer = Trainer(load_job_config([
            *TINY_ARGS, "--job.dump_folder", dump, "--training.steps", "8", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.async_mode", mode]))
        try:
            trainer.train()
            error = None
        except CheckpointError as exc:
            error = str(exc)
        trainer.close(clean=error is None)
        return {"error": error, "step": trainer.step}
    finally:
        FileSystemWriter.write_data = original


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_nothing_partial(tmp_path: Path, mode: str) -> None:
    dump = tmp_path / "job"
    ranks = run_distributed(_disk_full_at_step_4, 2, str(dump), mode)
    folder = dump / "checkpoint"
    for rank in ranks:
        error = rank["error"]
        assert error is not None and "\n" not in error
        assert error.startswith(f"saving checkpoint step 4 to {str(folder)!r} failed: No space left on device "
                                "(errno 28)"), error
        assert error.endswith("the partial folder was removed and the checkpoints [2] are intact"), error
    # Sync: the save at step 4 fails at once; async: the failure is reported at the next save.
    assert {r["step"] for r in ranks} == ({4} if mode == "disabled" else {6})
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert _finite_checkpoints(folder) == [2]
