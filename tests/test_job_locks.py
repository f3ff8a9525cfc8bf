"""A job's locks beyond its dump folder: the checkpoint folder's, and workers that end with their
launcher (an orphaned rank would train on and hold the locks)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.launcher_kills import children
from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, read_jsonl, run_distributed
from tests.test_dump_lock import start_torchrun
from tests.test_trainer_divergence import _main
from torchtitan_lite.checkpoint.manager import committed_steps
from torchtitan_lite.distributed.process_group import LAUNCHER_GONE_EXIT_CODE
from torchtitan_lite.errors import ConfigError
from torchtitan_lite.run.dump_lock import LOCK_FILE, DumpFolderLock

HANG_S = 120  # a bound on hangs only, never a speed requirement


def test_the_checkpoint_folder_has_its_own_lock_only_outside_the_dump_folder(tmp_path: Path) -> None:
    dump, other, shared = tmp_path / "dump", tmp_path / "other", tmp_path.resolve() / "shared-ckpt"
    assert DumpFolderLock(dump, checkpoint_folder="checkpoint").lock_files == [dump / LOCK_FILE]
    assert DumpFolderLock(dump, checkpoint_folder=dump / "a" / "b").lock_files == [dump / LOCK_FILE]
    assert DumpFolderLock(dump, checkpoint_folder="../shared-ckpt").lock_files == [dump / LOCK_FILE,
                                                                                  shared / LOCK_FILE]
    first = DumpFolderLock(dump, checkpoint_folder=shared)
    first.acquire()
    try:
        holder = json.loads((shared / LOCK_FILE).read_text())
        second = DumpFolderLock(other, checkpoint_folder=shared)
        with pytest.raises(ConfigError) as refused:
            second.acquire()
        assert str(refused.value) == (
            f"checkpoint.folder: invalid value {str(shared)!r}; another job is using it (pid {os.getpid()} on "
            f"{holder['host']}, started {holder['started']}; lock {str(shared / LOCK_FILE)!r}); wait for it to "
            "end or use another checkpoint.folder")
        # The refused job holds nothing, not even its own dump folder's lock.
        alone = DumpFolderLock(other)
        alone.acquire()
        alone.release()
        # A job whose dump folder is the other's checkpoint folder is refused too (by its dump lock).
        with pytest.raises(ConfigError, match=r"^job\.dump_folder: .*another job is using it"):
            DumpFolderLock(shared).acquire()
    finally:
        first.release()
    again = DumpFolderLock(other, checkpoint_folder=shared)
    again.acquire()
    again.release()


def _checkpointing_job(dump: Path, checkpoint_folder: Path) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--checkpoint.enable", "--checkpoint.folder",
            str(checkpoint_folder), "--checkpoint.interval", "2"]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_second_job_into_a_busy_absolute_checkpoint_folder_exits_and_leaves_the_first_alone(
        tmp_path: Path) -> None:
    root = tmp_path.resolve()
    shared = root / "shared-ckpt"
    first = start_torchrun(_checkpointing_job(root / "first", shared), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + HANG_S
        holder: dict[str, object] = {}
        while "pid" not in holder:  # the first job's rank 0 holds the checkpoint folder's lock
            assert first.poll() is None and time.monotonic() < deadline, "the first job never took its locks"
            time.sleep(0.05)
            try:
                holder = json.loads((shared / LOCK_FILE).read_text())
            except (OSError, ValueError):
                pass
        # The holder is frozen while the second job tries (its rank 1 waits in a collective), so
        # the attempt cannot come too late however fast or slow the machine is.
        pid = int(holder["pid"])
        os.kill(pid, signal.SIGSTOP)
        try:
            assert first.poll() is None, "the first job ended before it could be paused"
            second = root / "second"
            code, err = run_distributed(_main, 2, _checkpointing_job(second, shared), timeout=HANG_S)[0]
        finally:
            os.kill(pid, signal.SIGCONT)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and lines == [
            f"error: checkpoint.folder: invalid value {str(shared)!r}; another job is using it (pid {pid} on "
            f"{holder['host']}, started {holder['started']}; lock {str(shared / LOCK_FILE)!r}); wait for it to "
            "end or use another checkpoint.folder"], (code, err)
        assert [p.name for p in second.iterdir()] == [LOCK_FILE]  # it wrote nothing but its own lock
        # The same job alone (to compare with), while the first one finishes.
        solo = run_distributed(_main, 2, _checkpointing_job(root / "solo", root / "solo-ckpt"), timeout=HANG_S)
        assert solo[0][0] == 0, solo[0][1][-3000:]
        out, err = first.communicate(timeout=HANG_S)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, err[-3000:]
    # The first job's checkpoints and losses are those of the same job run alone.
    assert committed_steps(shared) == committed_steps(root / "solo-ckpt") == [2, 4]
    losses = [r["loss"] for r in read_jsonl(root / "first" / "metrics.jsonl")]
    assert len(losses) == 4 and losses == [r["loss"] for r in read_jsonl(root / "solo" / "metrics.jsonl")]


def _set_child_subreaper(on: bool) -> None:
    """Orphaned descendants of this process are handed to it (and can be waited for) while on."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(ctypes.c_int(36), ctypes.c_ulong(int(on)), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) == 0, os.strerror(ctypes.get_errno())  # PR_SET_CHILD_SUBREAPER


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_exit_when_their_launcher_is_killed_and_free_the_lock(tmp_path: Path) -> None:
    dump = tmp_path / "job"
    stderr = tmp_path / "stderr.txt"
    # This process adopts the orphaned workers, so that their exit codes can be read.
    _set_child_subreaper(True)
    workers: list[int] = []
    exits: dict[int, int] = {}
    try:
        with stderr.open("w") as err_file:
            agent = start_torchrun([*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "100000"],
                                   stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.monotonic() + HANG_S
            metrics = dump / "metrics.jsonl"
            while not metrics.is_file() or not metrics.read_text().strip():  # a step was trained
                assert agent.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
                time.sleep(0.05)
            workers = children(agent.pid)
            assert len(workers) == 2, workers
        finally:
            workers = workers or children(agent.pid)
            agent.kill()  # SIGKILL to the agent alone: its workers run in sessions of their own
            agent.wait()
        deadline = time.monotonic() + 30
        while len(exits) < len(workers) and time.monotonic() < deadline:
            for pid in set(workers) - set(exits):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    exits[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        assert len(exits) == 2, f"workers still running 30 s after their launcher died: {set(workers) - set(exits)}"
    finally:
        for pid in set(workers) - set(exits):  # whatever happened, nothing is left running
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        _set_child_subreaper(False)
    assert sorted(exits.values()) == [LAUNCHER_GONE_EXIT_CODE] * 2, (exits, stderr.read_text()[-3000:])
    lines = [line for line in stderr.read_text().splitlines() if "the launcher of this worker" in line]
    assert sorted(lines) == [
        f"error: rank {rank}: the launcher of this worker (pid {agent.pid}) is gone; exiting with code "
        f"{LAUNCHER_GONE_EXIT_CODE} so that no orphaned rank trains on or holds the job's locks; start the job "
        "again (with checkpoint.enable it resumes from its last checkpoint)" for rank in (0, 1)]
    lock = DumpFolderLock(dump)  # the lock the orphans would have held is free
    lock.acquire()
    lock.release()


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T: stopped, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_blocked_in_a_collective_exits_within_5_s_of_its_launcher(tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP) as step 3 begins, so rank 0 waits inside a collective (C++,
    where no Python signal handler runs); the agent is SIGKILLed: rank 0 exits with 76 and its
    one line within 5 s (the watch thread), not at the collective's timeout (100 s). A stopped
    process stays stopped until continued: rank 1 is killed here."""
    dump = tmp_path / "job"
    stderr = tmp_path / "stderr.txt"
    _set_child_subreaper(True)
    workers: list[int] = []
    try:
        with stderr.open("w") as err_file:
            agent = start_torchrun([*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "100000"],
                                   entry=("tests/kill_at_step.py",), stdout=subprocess.DEVNULL, stderr=err_file,
                                   extra_env={"KILL_AT_STEP": "3", "KILL_RANK": "1", "KILL_SIGNAL": "SIGSTOP"})
        try:
            deadline = time.monotonic() + HANG_S
            while len(workers) < 2 or not any(_state(pid) == "T" for pid in workers):
                assert agent.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
                time.sleep(0.05)
                workers = children(agent.pid)
            time.sleep(1.0)  # rank 0 is inside step 3's first collective by now
            blocked = [pid for pid in workers if _state(pid) != "T"]
            assert len(blocked) == 1
        finally:
            agent.kill()
            agent.wait()
        killed = time.monotonic()
        while True:
            done, status = os.waitpid(blocked[0], os.WNOHANG)
            if done or time.monotonic() - killed > 60:  # (the hang bound: the dead store's timeout is 300 s)
                break
            time.sleep(0.02)
        waited = time.monotonic() - killed
    finally:
        for pid in workers:  # the stopped rank, and anything left
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        _set_child_subreaper(False)
    assert done and os.waitstatus_to_exitcode(status) == LAUNCHER_GONE_EXIT_CODE, (waited, stderr.read_text()[-3000:])
    assert "error: rank 0: the launcher of this worker" in stderr.read_text()


def test_a_process_not_started_by_an_elastic_agent_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_lite.distributed.process_group import exit_with_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    assert exit_with_launcher() is False
    assert signal.getsignal(signal.SIGUSR2) is before


# A worker whose launcher dies after the worker imported us but before it asked the kernel to be
# told (the race exit_with_launcher guards): it exits at once when it asks.
LATE_WORKER = """
import os, time
from torchtitan_lite.run import launcher_watch
print("imported", flush=True)
while os.getppid() == launcher_watch._launcher_pid:  # until the launcher is gone
    time.sleep(0.01)
launcher_watch.exit_with_launcher()
os.write(2, b"still running\\n")
"""
LAUNCHER = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(os.getpid(), worker.pid, flush=True)
assert worker.stdout.readline() == "imported\\n"
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_launcher_died_before_it_asked_to_be_told_exits_at_once(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TORCHELASTIC_RUN_ID": "test", "RANK": "0"}
    _set_child_subreaper(True)
    worker = 0
    try:
        with stderr.open("w") as err_file:
            launcher = subprocess.run([sys.executable, "-c", LAUNCHER, LATE_WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=err_file, text=True, timeout=HANG_S, check=True)
        launcher_pid, worker = map(int, launcher.stdout.split())
        deadline = time.monotonic() + HANG_S
        done, status = os.waitpid(worker, os.WNOHANG)
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
            done, status = os.waitpid(worker, os.WNOHANG)
        assert done, "the orphaned worker is still running"
        worker = 0
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)
            os.waitpid(worker, 0)
        _set_child_subreaper(False)
    assert os.waitstatus_to_exitcode(status) == LAUNCHER_GONE_EXIT_CODE, stderr.read_text()
    assert stderr.read_text().splitlines() == [
        f"error: rank 0: the launcher of this worker (pid {launcher_pid}) is gone; "
        f"exiting with code {LAUNCHER_GONE_EXIT_CODE} so that no orphaned rank trains on or holds the job's "
        "locks; start the job again (with checkpoint.enable it resumes from its last checkpoint)"]
