"""A torchrun worker ends with its launcher at every moment of its life: from its first line (before
torch's imports), when the launcher died even before that (the agent's store refuses), in each
phase of start-up (by injection: a rank paused in a phase while the other blocks on it), and a
relaunch takes the lock of a worker that is still ending. Measured over random kills by
``scripts/launcher_kills.py``."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.launcher_kills import children, launch_job, logged_losses, run_chain
from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, captured_log, free_port
from tests.test_dump_lock import start_torchrun
from tests.test_job_locks import _set_child_subreaper
from torchtitan_lite.run.dump_lock import LOCK_FILE, DumpFolderLock
from torchtitan_lite.run.launcher_watch import LAUNCHER_GONE_EXIT_CODE

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")

HANG_S = 120  # a bound on hangs only, never a speed requirement
ENTRY = ("tests/startup_phases.py",)  # python -m torchtitan_lite.train, with its phases marked
TAIL = ("exiting with code 76 so that no orphaned rank trains on or holds the job's locks; start the job again "
        "(with checkpoint.enable it resumes from its last checkpoint)")

# A launcher without torch (it starts in a few hundredths of a second): it starts the command
# in a session of its own, as torchrun does (its output discarded), prints its pid and waits to
# be killed. With
# STORE_PORT it first listens there, as torchrun's agent hosts the workers' store, and with
# EXIT_AT_ONCE it exits as soon as the worker is started.
LAUNCHER = """
import os, socket, subprocess, sys, time
if os.environ.get("STORE_PORT"):
    store = socket.create_server(("127.0.0.1", int(os.environ["STORE_PORT"])))
os.environ["TEST_LAUNCHER_PID"] = str(os.getpid())
worker = subprocess.Popen(sys.argv[1:], start_new_session=True, stdout=subprocess.DEVNULL)
print(worker.pid, flush=True)
if not os.environ.get("EXIT_AT_ONCE"):
    time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "test",
           "RANK": "0", **extra}
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "PAUSE_IN", "PHASE_LOG"):
        if key not in extra:
            env.pop(key, None)
    return env


@contextlib.contextmanager
def _adopting() -> Iterator[set[int]]:
    """This process adopts orphaned descendants meanwhile (their exit codes can be read); the pids
    added to the set it yields are killed on the way out, whatever happened."""
    _set_child_subreaper(True)
    pids: set[int] = set()
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        _set_child_subreaper(False)


def _exit_of(pid: int, within: float, *, since: float | None = None) -> tuple[int | None, float]:
    """The exit code of this process's child ``pid`` and how long after ``since`` (a monotonic
    time; default now) it ended (None: still running ``within`` seconds after it)."""
    start = time.monotonic() if since is None else since
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - start
        if time.monotonic() - start > within:
            return None, time.monotonic() - start
        time.sleep(0.01)


def _wait_for(predicate: object, what: str, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():  # type: ignore[operator]
        assert proc is None or proc.poll() is None, f"{what}: the launcher ended first ({proc.returncode})"
        assert time.monotonic() < deadline, f"{what}: not within {HANG_S} s"
        time.sleep(0.02)


def _logged(log: Path, *entries: str) -> bool:
    """Whether the phase log (``<time> <rank> <pid> <phase>`` lines) holds every ``"<rank> <phase>"``."""
    try:
        lines = [line.split() for line in log.read_text().splitlines()]
    except FileNotFoundError:
        return False
    seen = {f"{parts[1]} {parts[3]}" for parts in lines if len(parts) == 4}
    return all(entry in seen for entry in entries)


def test_the_entry_point_watches_its_launcher_before_torch_is_imported(tmp_path: Path) -> None:
    """``python -m torchtitan_lite.train`` paused as it begins to import torch (the seconds of a
    2-core machine's imports) and its launcher SIGKILLed: it ends with 76 and its line."""
    log, err = tmp_path / "phases", tmp_path / "stderr"
    with _adopting() as pids, err.open("w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, *ENTRY, *TINY_ARGS,
                                     "--job.dump_folder", str(tmp_path / "job")], cwd=REPO_ROOT, text=True,
                                    env=_env(PAUSE_IN="imports", PHASE_LOG=str(log)), stdout=subprocess.PIPE,
                                    stderr=stderr)
        assert launcher.stdout is not None
        worker = int(launcher.stdout.readline())
        pids.add(worker)
        _wait_for(lambda: _logged(log, "0 imports", "0 paused"), "the worker's pause", launcher)
        launcher.kill()
        launcher.wait()
        code, _ = _exit_of(worker, HANG_S)
    assert code == LAUNCHER_GONE_EXIT_CODE, err.read_text()[-3000:]
    assert err.read_text().splitlines() == [
        f"error: rank 0: the launcher of this worker (pid {launcher.pid}) is gone; {TAIL}"]


WORKER_AFTER_ITS_LAUNCHER = """
import os, subprocess, sys, time
while os.getppid() == int(os.environ["TEST_LAUNCHER_PID"]):  # until the launcher is gone: before our first line
    time.sleep(0.01)
from torchtitan_lite.run.launcher_watch import exit_with_launcher
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as out:
    out.write(str(child.pid))
exit_with_launcher()
time.sleep(600)
"""


def test_a_worker_whose_launcher_died_before_its_first_line_learns_it_from_the_agent_store(tmp_path: Path) -> None:
    """Its parent was already another process when it first looked; the agent's store (which the
    agent hosts from before any worker starts) refuses connections: 76 and a line naming the store.
    What the worker started (here a sleeping child: ``auto``'s planner) ends with it."""
    port, err = free_port(), tmp_path / "stderr"
    with _adopting() as pids, err.open("w") as stderr:
        launcher = subprocess.run(
            [sys.executable, "-c", LAUNCHER, sys.executable, "-c", WORKER_AFTER_ITS_LAUNCHER, str(tmp_path / "child")],
            cwd=REPO_ROOT, stderr=stderr, stdout=subprocess.PIPE,
            env=_env(STORE_PORT=str(port), EXIT_AT_ONCE="1", TORCHELASTIC_USE_AGENT_STORE="True",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            text=True, timeout=HANG_S, check=True)
        worker = int(launcher.stdout)
        pids.add(worker)
        code, _ = _exit_of(worker, HANG_S)
        child = int((tmp_path / "child").read_text())
        pids.add(child)
        child_code, _ = _exit_of(child, HANG_S)  # killed by the worker; this process adopted it
    assert code == LAUNCHER_GONE_EXIT_CODE, err.read_text()[-3000:]
    assert err.read_text().splitlines() == [
        f"error: rank 0: the launcher of this worker (its store at 127.0.0.1:{port} refuses connections) is gone; "
        f"{TAIL}"]
    assert child_code == -signal.SIGKILL


HOLDER = """
import sys, time
from torchtitan_lite.run.launcher_watch import exit_with_launcher
from torchtitan_lite.run.dump_lock import DumpFolderLock
exit_with_launcher()
lock = DumpFolderLock(sys.argv[1])
lock.acquire()
time.sleep(600)
"""


def test_a_relaunch_waits_for_the_lock_of_a_worker_that_is_still_ending(tmp_path: Path) -> None:
    """The lock's holder is a worker whose launcher is gone, stopped (SIGSTOP) so that it cannot
    end yet; it is continued half a second later and ends (76). The new job takes the lock then,
    instead of being refused; it says how long it waited."""
    folder = tmp_path / "job"
    with _adopting() as pids:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, "-u", "-c", HOLDER,
                                     str(folder)], cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
        assert launcher.stdout is not None
        holder = int(launcher.stdout.readline())
        pids.add(holder)
        _wait_for(lambda: "launcher" in _read_json(folder / LOCK_FILE), "the holder's lock", launcher)
        assert json.loads((folder / LOCK_FILE).read_text())["launcher"] == launcher.pid
        os.kill(holder, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        threading.Timer(0.5, os.kill, (holder, signal.SIGCONT)).start()
        with captured_log() as lines:
            lock = DumpFolderLock(folder)
            lock.acquire()
        lock.release()
        code, _ = _exit_of(holder, HANG_S)
    assert code == LAUNCHER_GONE_EXIT_CODE
    assert len(lines) == 1 and lines[0].startswith("job.dump_folder: waited ") and lines[0].endswith(
        f" s for pid {holder}, a worker whose launcher is gone, to release {folder / LOCK_FILE}"), lines


def _read_json(path: Path) -> dict[str, object]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or being written
        return {}


# --------------------------------------------------------------------------------------------
# Real torchrun: each phase of start-up by injection, and random kills with relaunches
# --------------------------------------------------------------------------------------------

# The phase rank 0 pauses in, and the phase rank 1 reaches before it blocks on rank 0 in C++ code:
# on the agent's store (the attempt handshake), inside init_process_group, in a collective.
_BLOCKS_IN = {"imports": "rendezvous", "rendezvous": "rendezvous", "process_group": "process_group",
              "model": "model", "steps": "steps"}


def _workers_after_a_launcher_kill(tmp_path: Path, args: list[str], ready: list[str],
                                   extra_env: dict[str, str]) -> tuple[int, dict[int, tuple[int | None, float]], str,
                                                                      list[int]]:
    """Start torchrun (``tests/startup_phases.py``), wait until its phase log holds every
    ``ready`` entry (``"<rank> <phase>"``) and half a second more, SIGKILL the agent and wait
    for its two workers as their subreaper. Returns the agent's pid, each worker's exit code and
    time to end (None: running 60 s on, then killed), their stderr, and the pids of the
    workers' own children when the agent was killed (reaped here too)."""
    log, err = tmp_path / "phases", tmp_path / "stderr"
    ended: dict[int, tuple[int | None, float]] = {}
    with _adopting() as pids, err.open("w") as stderr:
        agent = start_torchrun([*args, "--job.dump_folder", str(tmp_path / "job")], entry=ENTRY,
                               extra_env={"PHASE_LOG": str(log), **extra_env}, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            _wait_for(lambda: _logged(log, *ready), f"phases {ready}", agent)
            time.sleep(0.5)  # the other rank is blocked by now
            workers = children(agent.pid)
            grandchildren = [child for worker in workers for child in children(worker)]
            pids.update(workers + grandchildren)
            assert len(workers) == 2, workers
        finally:
            agent.kill()
            killed = time.monotonic()
            agent.wait()
        for pid in workers:
            ended[pid] = _exit_of(pid, 60, since=killed)  # (the hang bound: noticing takes 0.1-1 s, not noticing 300 s)
        for pid in grandchildren:
            _exit_of(pid, 60)
    return agent.pid, ended, err.read_text(), grandchildren


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("phase", list(_BLOCKS_IN))
def test_workers_end_with_a_launcher_killed_in_each_phase_of_start_up(tmp_path: Path, phase: str) -> None:
    """Rank 0 paused in ``phase`` (in Python), rank 1 blocked on it (C++ code: the store, gloo's
    set-up, a collective); the agent SIGKILLed: both end with 76 and one line each at once,
    not at comm.init_timeout_seconds (300 s)."""
    agent, ended, err, _ = _workers_after_a_launcher_kill(
        tmp_path, [*TINY_ARGS, "--training.steps", "100000"], ["0 paused", f"1 {_BLOCKS_IN[phase]}"],
        {"PAUSE_IN": phase})
    print(f"launcher killed with rank 0 paused in {phase}: workers ended after "
          f"{', '.join(f'{seconds:.3f} s' for _, seconds in ended.values())}")
    assert [code for code, _ in ended.values()] == [LAUNCHER_GONE_EXIT_CODE] * 2, (ended, err[-3000:])
    lines = sorted(line for line in err.splitlines() if "the launcher of this worker" in line)
    assert lines == [f"error: rank {rank}: the launcher of this worker (pid {agent}) is gone; {TAIL}"
                     for rank in (0, 1)]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_workers_and_autos_planner_end_with_a_launcher_killed_while_auto_plans(tmp_path: Path) -> None:
    """``auto``: rank 0 plans in a child process (seconds), rank 1 waits for the plan; the agent
    SIGKILLed meanwhile: both workers end with 76 at once, and the planner with them."""
    args = [*TINY_ARGS, "--training.steps", "100000", "--parallelism.reshard_after_forward_mode", "auto",
            "--parallelism.memory_budget_gib", "1"]
    _, ended, err, planners = _workers_after_a_launcher_kill(tmp_path, args, ["0 auto", "1 auto"], {})
    print(f"launcher killed while auto plans: workers ended after "
          f"{', '.join(f'{seconds:.3f} s' for _, seconds in ended.values())}")
    assert [code for code, _ in ended.values()] == [LAUNCHER_GONE_EXIT_CODE] * 2, (ended, err[-3000:])
    assert len(planners) == 1, planners  # (killed by rank 0 and reaped by _workers_after_a_launcher_kill)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_random_launcher_kills_across_start_up_then_relaunches_give_the_uninterrupted_losses(tmp_path: Path) -> None:
    """Three SIGKILLs of the agent's process group in a row, each at a random moment of its
    launch's first 6 s (start-up, mostly), each launch started at once after the last: every
    worker ends at once, no relaunch is refused a lock, and the job run to its end logs the
    losses of an uninterrupted run at every step (resumed steps included), no checkpoint damaged.
    ``scripts/launcher_kills.py --startup`` does the same over 50 kills of each kind."""
    steps, seed = 120, random.randrange(2**32)
    _set_child_subreaper(True)  # (launcher_kills measures the orphans as their subreaper)
    try:
        reference = launch_job(tmp_path / "reference", steps, tmp_path / "ref-phases", tmp_path / "ref-out")
        assert reference.wait(timeout=HANG_S * 5) == 0, (tmp_path / "ref-out").read_text()[-3000:]
        losses = dict(logged_losses(tmp_path / "reference" / "metrics.jsonl"))
        chain = run_chain(tmp_path / "chain", "group-kill", 3, 6.0, steps, random.Random(seed), losses)
    finally:
        _set_child_subreaper(False)
    hit = [w for result in chain["rounds"] if not result["finished"] for w in result["workers"]]
    assert all(w["outlived_s"] is not None for w in hit), (seed, chain["rounds"])  # (gone within the 60 s hang bound)
    assert chain["refused"] == 0 and chain["final_exit"] == 0, (seed, chain)
    assert chain["steps_covered"] == steps and not chain["differ"] and not chain["damaged"], (seed, chain)
