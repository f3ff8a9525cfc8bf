"""Run a function on N CPU processes over gloo, the way torchrun would, and collect results.

Each process gets one thread, its own ``RANK``/``WORLD_SIZE`` and a free port shared by the
group. A process that fails or hangs fails the test with its traceback, and every process is
killed before the helper returns, so nothing is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_lite.distributed import free_port

__all__ = ["REPO_ROOT", "free_port", "read_jsonl", "run_command", "run_distributed", "run_torchrun"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (e.g. a job's metrics.jsonl)."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int,
            queue: Any, args: tuple[Any, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 240.0) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function) and should initialise the process
    group itself (e.g. through ``torchtitan_lite.distributed.init_distributed``).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, queue, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout:.0f}s "
                                   f"({len(results)} of {world_size} ranks finished)")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    # A rank died without reporting (e.g. a C++ abort): give others a moment.
                    time.sleep(2)
                    if queue.empty():
                        raise RuntimeError(
                            f"rank process exited with code {dead[0].exitcode} without a result"
                        ) from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
        if errors:
            raise RuntimeError("distributed test failed on " + "\n".join(errors))
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def run_torchrun(args: list[str], *, nproc: int, timeout: float = 300.0,
                 cwd: Path | None = None, extra_env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --nproc_per_node=nproc -m torchtitan_lite.train ARGS`` on a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--nnodes=1", "-m", "torchtitan_lite.train", *args]
    return run_command(cmd, timeout=timeout, cwd=cwd, extra_env=extra_env)


def run_command(cmd: list[str], *, timeout: float = 300.0, cwd: Path | None = None,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; kill the whole group on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
           **(extra_env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd or REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"command timed out after {timeout}s: {cmd}\n{out}\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
