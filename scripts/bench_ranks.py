"""The benchmarks' rank launcher: spawned gloo processes on a free port, one result each."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def run_ranks(target: Callable[..., None], ranks: int, *args: Any, timeout: float = 1800) -> list[Any]:
    """Run ``target(rank, ranks, port, *args, out)`` in ``ranks`` spawned processes; each puts its
    result on ``out``. Returns the results in the order they came."""
    from torchtitan_lite.distributed import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, *args, out)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join()
    return results
