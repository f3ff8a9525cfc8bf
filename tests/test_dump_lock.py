"""One job per dump folder: the lock, and two jobs started into one folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, read_jsonl, run_distributed
from tests.test_trainer_divergence import _main
from torchtitan_lite.checkpoint.manager import committed_steps
from torchtitan_lite.errors import ConfigError
from torchtitan_lite.run.dump_lock import LOCK_FILE, DumpFolderLock

HOLD = """
import sys, time
from torchtitan_lite.run.dump_lock import DumpFolderLock
lock = DumpFolderLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _try_lock(folder: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\nfrom torchtitan_lite.run.dump_lock import DumpFolderLock\n"
        "from torchtitan_lite.errors import ConfigError\n"
        "try:\n    DumpFolderLock(sys.argv[1]).acquire()\nexcept ConfigError as e:\n    print(e)\n    sys.exit(2)\n"
    )
    return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_lock_names_its_holder_and_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    refused = _try_lock(tmp_path)
    assert refused.returncode == 2
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert refused.stdout.strip() == (
        f"job.dump_folder: invalid value {str(tmp_path)!r}; another job is using it (pid {os.getpid()} on "
        f"{holder['host']}, started {holder['started']}; lock {str(tmp_path / LOCK_FILE)!r}); wait for it to end "
        "or use another job.dump_folder")
    lock.release()
    assert _try_lock(tmp_path).returncode == 0
    # A holder killed with SIGKILL (no clean-up of its own) leaves no stale lock.
    holder_proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder_proc.stdout is not None and holder_proc.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"pid {holder_proc.pid} on "):
            DumpFolderLock(tmp_path).acquire()
    finally:
        holder_proc.send_signal(signal.SIGKILL)
        holder_proc.wait()
    again = DumpFolderLock(tmp_path)
    again.acquire()
    again.release()


def start_torchrun(args: list[str], *, entry: tuple[str, ...] = ("-m", "torchtitan_lite.train"),
                   extra_env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    """``torchrun --nproc_per_node=2 -m torchtitan_lite.train ARGS`` (or another ``entry``) in a
    session of its own, one thread per rank, without the launcher variables of the calling
    process (``popen``: where its output goes). The caller ends it (its workers run in sessions
    of their own)."""
    from torchtitan_lite.distributed import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", *entry, *args],
        cwd=REPO_ROOT, env=env, text=True, start_new_session=True, **popen)


def _job(dump: Path) -> list[str]:
    # Long enough (a second or two) that the first job is caught training and paused.
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "60", "--checkpoint.enable",
            "--checkpoint.interval", "20", "--checkpoint.keep_latest_k", "2", "--metrics.log_freq", "10"]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_second_job_into_a_busy_folder_exits_at_once_and_leaves_the_first_alone(tmp_path: Path) -> None:
    shared, solo = tmp_path / "shared", tmp_path / "solo"
    first = start_torchrun(_job(shared), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        metrics = shared / "metrics.jsonl"
        while not metrics.is_file() or not metrics.read_text().strip():  # the first job is training
            assert first.poll() is None and time.monotonic() < deadline, "the first job never started training"
            time.sleep(0.05)
        # Its rank 0 (the lock holder; rank 1 then waits in a collective) is frozen while the
        # second job tries: the attempt cannot come too late however slow the machine is.
        holder = json.loads((shared / LOCK_FILE).read_text())["pid"]
        os.kill(holder, signal.SIGSTOP)
        try:
            assert first.poll() is None, "the first job ended before it could be paused"
            code, err = run_distributed(_main, 2, _job(shared))[0]
        finally:
            os.kill(holder, signal.SIGCONT)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (code, err)
        assert lines[0].startswith(f"error: job.dump_folder: invalid value {str(shared)!r}; another job is using "
                                   "it (pid "), lines
        out, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, err[-3000:]
    # The first job's checkpoints and metrics are those of the same job run alone.
    run_distributed(_main, 2, _job(solo))
    assert committed_steps(shared / "checkpoint") == committed_steps(solo / "checkpoint") == [40, 60]
    assert [r["loss"] for r in read_jsonl(shared / "metrics.jsonl")] == [
        r["loss"] for r in read_jsonl(solo / "metrics.jsonl")
    ]
    assert len({r["run_id"] for r in read_jsonl(shared / "metrics.jsonl")}) == 1
