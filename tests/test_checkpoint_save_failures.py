"""Saves that cannot succeed: a checkpoint folder that is a file, or on a read-only mount, is found
before training; a full disk during a save is one line naming the cause, the partial folder is
removed and the earlier checkpoints stay intact (sync and async); training goes on and saves
again, until ``checkpoint.max_failed_saves`` saves in a row have failed (exit 4)."""

from __future__ import annotations

import contextlib
import errno
import io
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import read_jsonl, run_distributed
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


@contextlib.contextmanager
def _full_disk(steps: set[int], rank: str = "1"):
    """Rank ``rank``'s DCP files of the saves of ``steps`` cannot be written (ENOSPC, as on a full disk)."""
    import os

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def full_disk(self: Any, plan: Any, planner: Any) -> Any:
        if os.environ.get("RANK", "0") == rank and any(f".step-{s}.partial" in str(self.path) for s in steps):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return original(self, plan, planner)

    FileSystemWriter.write_data = full_disk
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


def _disk_full_at_step_4(dump: str, mode: str) -> dict[str, Any]:
    """The trainer with saves every 2 steps, where rank 1's files of step 4 cannot be written,
    and the first failed save stops the job."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.errors import CheckpointError
    from torchtitan_lite.trainer import Trainer

    with _full_disk({4}):
        trainer = Trainer(load_job_config([
            *TINY_ARGS, "--job.dump_folder", dump, "--training.steps", "8", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.async_mode", mode, "--checkpoint.max_failed_saves", "1"]))
        try:
            trainer.train()
            error = None
        except CheckpointError as exc:
            error = str(exc)
        trainer.close(clean=error is None)
        return {"error": error, "step": trainer.step}


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


def _job_on_a_full_disk(dump: str, steps: int, full_at: set[int], mode: str, *extra: str) -> Any:
    """Through ``main`` on 2 ranks, saves every 5 steps, rank 1's files of the saves of steps
    ``full_at`` unwritable."""
    from tests.dist_utils import captured_log, run_main

    with _full_disk(full_at), captured_log() as lines:
        result = run_main([[*TINY_ARGS, "--job.dump_folder", dump, "--training.steps", str(steps),
                            "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.async_mode", mode,
                            "--validation.no-enable", "--metrics.no-enable_tensorboard", *extra]],
                          standalone=False)[0]
    result.stdout = "\n".join(lines)  # the log (rank 0's)
    return result


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_is_one_line_training_goes_on_and_too_many_failures_exit_4(tmp_path: Path, mode: str) -> None:
    """Step 10's save fails on one rank: one line on rank 0 (the folder, the OS error, step-5
    kept), the job trains on, saves step-15 and exits 0, and a resumed run starts from step 15
    (never from a partial folder). Every save failing with max_failed_saves = 2: the job stops
    with exit 4 at the second failure (async: found when the next save waits for it)."""
    once = run_distributed(_job_on_a_full_disk, 2, str(tmp_path / "once"), 15, {10}, mode)
    again = run_distributed(_job_on_a_full_disk, 2, str(tmp_path / "once"), 20, set(), mode)[0]
    always = run_distributed(_job_on_a_full_disk, 2, str(tmp_path / "always"), 20, {5, 10, 15, 20}, mode,
                             "--checkpoint.max_failed_saves", "2")
    assert [r.returncode for r in [*once, again, *always]] == [0, 0, 0, 4, 4], [r.stderr[-2000:] for r in always]
    (once, rank1), always, folder = once, always[0], tmp_path / "once" / "checkpoint"
    failed = [line for line in once.stdout.splitlines() if "failed" in line]
    assert len(failed) == 1 and failed[0].startswith(
        f"saving checkpoint step 10 to {str(folder)!r} failed: No space left on device (errno 28)"), once.stdout
    assert failed[0].endswith("the partial folder was removed and the checkpoints [5] are intact; training goes on "
                              "and the next save tries again (1 of checkpoint.max_failed_saves = 2 failed in a "
                              "row)".replace("= 2", "= 3")), failed
    assert not [line for line in rank1.stdout.splitlines() if "failed" in line]  # rank 1: no line of its own
    assert [r["step"] for r in read_jsonl(tmp_path / "once" / "metrics.jsonl")] == list(range(1, 21))
    assert f"resumed from {folder / 'step-15'} (step 15" in again.stdout, again.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["step-15", "step-20", "step-5"]

    lines = [line for line in always.stderr.splitlines() if line.startswith("error: ")]
    stop = 10 if mode == "disabled" else 15
    assert len(lines) == 1 and lines[0].startswith(
        f"error: saving checkpoint step 10 to {str(tmp_path / 'always' / 'checkpoint')!r} failed: No space "
        "left on device (errno 28)") and lines[0].endswith(
        "(2 saves in a row failed: checkpoint.max_failed_saves = 2)"), always.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "always" / "metrics.jsonl")][-1] == stop
    assert list((tmp_path / "always" / "checkpoint").iterdir()) == []


def _seed_on_a_full_disk(dump: str) -> Any:
    from tests.dist_utils import run_main

    with _full_disk({0}, rank="0"):
        return run_main([[*TINY_ARGS, "--job.dump_folder", dump, "--checkpoint.create_seed_checkpoint",
                          "--checkpoint.enable", "--checkpoint.async_mode", "async"]])[0]


def test_a_seed_checkpoint_that_cannot_be_written_exits_4_even_with_async_saves(tmp_path: Path) -> None:
    """The seed is the whole job: its failed save stops it (exit 4, one line), never a log line
    and exit 0, whatever ``async_mode`` says."""
    (result,) = run_distributed(_seed_on_a_full_disk, 1, str(tmp_path / "job"))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 4 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"error: saving checkpoint step 0 to {str(tmp_path / 'job' / 'checkpoint')!r} "
                               "failed: No space left on device (errno 28)"), lines
    assert not list((tmp_path / "job" / "checkpoint").iterdir())
