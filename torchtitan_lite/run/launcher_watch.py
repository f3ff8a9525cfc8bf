"""A torchrun worker ends when its launcher dies, from its first line of Python to its last.

torchrun (torch 2.13) starts every worker in a session of its own, so an agent killed with
SIGKILL (the OOM killer, a scheduler, ``kill -9``) takes no worker with it: a worker would train on
as an orphan, or wait out ``comm.init_timeout_seconds`` on the dead agent's store during start-up,
holding the job's locks and its memory. :func:`exit_with_launcher` ends such a worker within
:data:`LAUNCHER_GONE_BOUND_S` with :data:`LAUNCHER_GONE_EXIT_CODE` (76).

This module imports only the standard library, so that ``torchtitan_lite/train.py`` can arm the
watch as its first statement, before the seconds that ``import torch`` and the rest take;
:func:`~torchtitan_lite.distributed.process_group.init_distributed` arms it too (for workers that
enter through their own script), and :mod:`torchtitan_lite.run.dump_lock` records the launcher beside
the lock's holder (:func:`launcher_pid`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn

__all__ = ["LAUNCHER_GONE_BOUND_S", "LAUNCHER_GONE_EXIT_CODE", "LAUNCHER_POLL_S", "exit_with_launcher",
           "launcher_pid", "orphaned"]

logger = logging.getLogger(__name__)

LAUNCHER_GONE_EXIT_CODE = 76
"""Exit status of a torchrun worker that ended because its launcher died
(:func:`exit_with_launcher`); 75 is a preemption's (``errors.PREEMPTED_EXIT_CODE``), 1-5 the
job's own errors."""
LAUNCHER_POLL_S = 0.2
"""How often the watch thread of :func:`exit_with_launcher` checks that the launcher lives."""
LAUNCHER_GONE_BOUND_S = 2.0
"""The stated bound on how long a worker outlives its launcher (the poll, and the time to write
one line and exit, with room for a loaded machine and for C++ code such as ``import torch``'s
that holds the interpreter for a few tenths of a second); the tests hold it at 5 s. A new job
into the folder of such a worker waits for its lock as long (:mod:`torchtitan_lite.run.dump_lock`)."""

_LAUNCHER_SIGNAL = "SIGUSR2"  # not SIGTERM/SIGUSR1/SIGINT: those are checkpoint.save_on_signals'
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STORE_PROBE_S = 1.0  # a probe of the agent's store that gets no answer in this time proves nothing

_launcher_pid = os.getppid()  # this process's parent when it imported us (or forked: see below)
_watching_launcher = False
_orphan_exit = threading.Lock()


def _record_launcher() -> None:
    global _launcher_pid, _watching_launcher
    _launcher_pid = os.getppid()
    _watching_launcher = False  # a forked child does not inherit PR_SET_PDEATHSIG


if hasattr(os, "register_at_fork"):  # a forked child's launcher is the process that forked it
    os.register_at_fork(after_in_child=_record_launcher)


def launcher_pid() -> int | None:
    """The process id of this worker's launcher while :func:`exit_with_launcher` watches it
    (None otherwise)."""
    return _launcher_pid if _watching_launcher else None


def orphaned(pid: int, launcher: int) -> bool:
    """Whether process ``pid`` of this machine, launched by ``launcher``, has lost it: its parent
    is another process now (or ``pid`` is gone). False where ``/proc`` cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return int(stat[stat.rindex(")") + 2:].split()[1]) != launcher


def exit_with_launcher() -> bool:
    """End this process when the process that launched it dies; for workers of torchrun (or
    another torch elastic agent). Returns whether the watch is on.

    The launcher is this process's parent when this module was imported: ``torchtitan_lite/
    train.py`` imports it and calls this as its first statement, so the watch covers torch's
    imports, the config, the rendezvous on the agent's store, ``init_process_group``, the model
    build, ``auto``'s planning, data loading and every step. The kernel is asked
    (``prctl(PR_SET_PDEATHSIG)``) to send this process SIGUSR2 when its parent dies; the
    handler writes one line on stderr and ends the process at once with
    :data:`LAUNCHER_GONE_EXIT_CODE` (76), with no clean-up: the operating system releases the
    locks, and what a save in progress left is a partial folder, never a committed step. Child
    processes it started (``auto``'s planner) are killed first. The handler runs only when the
    main thread next runs Python code, so a daemon thread also checks the parent every
    :data:`LAUNCHER_POLL_S` seconds and ends the process the same way: a rank blocked on the
    agent's store, in a collective, a background save or I/O (which release the interpreter) is
    gone within :data:`LAUNCHER_GONE_BOUND_S` of its launcher. SIGUSR2 while the launcher lives
    (sent by hand, or the end of the launcher's thread that started this process) is ignored.

    A launcher that died before this module was imported (in the few hundredths of a second
    between the worker's start and its first line) left it with another parent already. The
    watch thread then finds out from the agent's store (torchrun's c10d and static rendezvous,
    ``TORCHELASTIC_USE_AGENT_STORE=True``): the agent that hosts it listens from before any
    worker starts until it dies, so a connection to ``MASTER_ADDR:MASTER_PORT`` that is refused
    means it is gone (the whole job with it) and the worker exits the same way. A launcher that
    died before this call, after the import, is noticed at once (the parent changed).

    Only on Linux, from the main thread, and only under an elastic agent
    (``TORCHELASTIC_RUN_ID`` in the environment); otherwise, e.g. ``python -m
    torchtitan_lite.train`` without torchrun or any other system, nothing changes and it returns
    False. Calling it again does nothing. Limits: a stopped process (SIGSTOP) stays stopped
    until it is continued; C++ code that holds the interpreter for seconds delays the exit by
    as much; on a node other than the store's, a launcher that died before the worker's first
    line is not noticed (the worker then runs with the job until it ends or fails).
    """
    global _watching_launcher
    if _watching_launcher:
        return True
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if threading.current_thread() is not threading.main_thread():
        logger.warning("this worker will not exit by itself if its launcher dies: the handler of %s can only be "
                       "installed from the main thread", _LAUNCHER_SIGNAL)
        return False
    sig = signal.Signals[_LAUNCHER_SIGNAL]
    previous = signal.signal(sig, _on_launcher_signal)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(int(sig)), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        signal.signal(sig, previous)
        logger.warning("this worker will not exit by itself if its launcher dies: prctl(PR_SET_PDEATHSIG) "
                       "failed (%s)", os.strerror(ctypes.get_errno()))
        return False
    _watching_launcher = True
    if _launcher_gone():  # it died after the import, before the kernel was asked to tell us
        _exit_orphan()
    threading.Thread(target=_watch_launcher, name="torchtitan_lite-launcher-watch", daemon=True).start()
    return True


def _watch_launcher() -> None:
    refused = _agent_store_refuses()
    if refused:
        _exit_orphan(refused)
    while not _launcher_gone():
        time.sleep(LAUNCHER_POLL_S)
    _exit_orphan()


def _launcher_gone() -> bool:
    """The parent changed: the launcher died and this process was handed to PID 1 or a
    subreaper. (A launcher that is PID 1 itself, in a container, is fine as long as it lives.)"""
    return os.getppid() != _launcher_pid


def _agent_store_refuses() -> str:
    """``"host:port"`` of the torchrun agent's store when it refuses connections (the agent that
    hosts it is gone), else ``""`` (it answers, gives no answer in time, or there is none)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return ""
    try:
        socket.create_connection((host, int(port)), timeout=_STORE_PROBE_S).close()
    except ConnectionRefusedError:
        return f"{host}:{port}"
    except OSError:  # no route, no answer in time, a name that does not resolve: not a proof
        pass
    return ""


def _on_launcher_signal(signum: int, frame: FrameType | None) -> None:
    if _launcher_gone():
        _exit_orphan()


def _kill_children() -> None:
    """SIGKILL the processes this one started (``auto``'s planner, compile workers): they would
    otherwise run on after it."""
    for task in Path("/proc/self/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def _exit_orphan(store: str = "") -> NoReturn:
    """One line on stderr (written directly: this may run inside a signal handler), then exit.
    ``store``: the agent's store that refused a connection, when that is how it was found out.
    The handler and the watch thread may both get here: one writes, the other waits for it."""
    if not _orphan_exit.acquire(timeout=1.0):
        os._exit(LAUNCHER_GONE_EXIT_CODE)
    _kill_children()
    who = (f"(its store at {store} refuses connections)" if store else f"(pid {_launcher_pid})")
    line = (f"error: rank {os.environ.get('RANK', '?')}: the launcher of this worker {who} is gone; exiting with "
            f"code {LAUNCHER_GONE_EXIT_CODE} so that no orphaned rank trains on or holds the job's locks; start the "
            "job again (with checkpoint.enable it resumes from its last checkpoint)\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass
    os._exit(LAUNCHER_GONE_EXIT_CODE)
