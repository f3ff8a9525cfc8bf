"""``torchrun ... tests/startup_phases.py TRAIN_ARGS``: ``python -m torchtitan_lite.train`` (run as
``__main__``, so its first statement arms the launcher watch before torch is imported), with the
phases of a worker's life marked:

    imports  config  data  rendezvous  process_group  auto  model  steps

``imports`` begins as ``train.py`` first imports torch; ``rendezvous`` as the process group's
set-up begins (the agent's store, the attempt handshake); ``process_group`` as
``init_process_group`` begins (then the lock and the mesh); ``auto`` as the ranks agree on
``auto``'s plan (rank 0's planner runs in a child process); ``steps`` as the first step begins.

- ``PHASE_LOG=<file>``: each rank appends ``<unix time> <rank> <pid> <phase>`` as it enters a
  phase (``scripts/launcher_kills.py --startup`` tells from it which phase a kill hit).
- ``PAUSE_IN=<phase>`` (and ``PAUSE_RANK``, default 0; ``all`` for every rank): the rank stops
  in that phase (it sleeps in Python, ``paused`` in the log) and never goes on; the other ranks
  go on until they block on it (on the store, in ``init_process_group`` or a collective: C++
  code). Used by tests/test_launcher_watch.py.

Only marks and pauses: the job is otherwise the real one. The hooks are installed by an import
hook, before ``torchtitan_lite.train`` runs.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PHASES = ("imports", "config", "data", "rendezvous", "process_group", "auto", "model", "steps")


def mark(phase: str) -> None:
    """Enter ``phase``: log it, and stop here for good when ``PAUSE_IN`` names it for this rank."""
    rank = os.environ.get("RANK", "?")
    log = os.environ.get("PHASE_LOG")
    paused = os.environ.get("PAUSE_IN") == phase and os.environ.get("PAUSE_RANK", "0") in (rank, "all")
    if log:
        line = "".join(f"{time.time():.4f} {rank} {os.getpid()} {what}\n" for what in [phase, "paused"][:1 + paused])
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    while paused:
        time.sleep(0.5)


def _marked(phase: str, fn: Callable[..., Any], *, once: bool = False) -> Callable[..., Any]:
    done = [False]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (once and done[0]):
            done[0] = True
            mark(phase)
        return fn(*args, **kwargs)

    return wrapper


def _patch(name: str, module: ModuleType) -> None:
    """Mark the phases of ``module`` right after it ran (before anyone imported names from it)."""
    if name == "torch.distributed":
        module.init_process_group = _marked("process_group", module.init_process_group)
    elif name == "torchtitan_lite.config":
        module.load_job_config = _marked("config", module.load_job_config)
    elif name == "torchtitan_lite.trainer":
        module.build_data = _marked("data", module.build_data)
        module.init_distributed = _marked("rendezvous", module.init_distributed)
        module.agree_auto_reshard = _marked("auto", module.agree_auto_reshard)
        module.build_parallel_model = _marked("model", module.build_parallel_model, once=True)
        module.Trainer.train_step = _marked("steps", module.Trainer.train_step, once=True)


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, inner: importlib.abc.Loader) -> None:
        self.name, self.inner = name, inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface (resources, file names)
        return getattr(self.inner, name)

    def exec_module(self, module: ModuleType) -> None:
        if self.name == "torch":
            mark("imports")
        self.inner.exec_module(module)
        _patch(self.name, module)


class _Finder(importlib.abc.MetaPathFinder):
    NAMES = ("torch", "torch.distributed", "torchtitan_lite.config", "torchtitan_lite.trainer")

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(name, spec.loader)
                return spec
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _Finder())
    runpy.run_module("torchtitan_lite.train", run_name="__main__", alter_sys=True)
