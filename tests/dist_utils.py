"""Run a function on N CPU processes over gloo, the way torchrun would, and collect results.

Each rank gets one thread, its own ``RANK``/``WORLD_SIZE`` and a free port shared by the
group. The rank processes are kept between calls of the same size (importing torch costs more
than most tests); a rank that fails or hangs fails the test with its traceback and every rank
of that size is killed, and the session's end stops the rest (``conftest.py``), so nothing is
left behind.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchtitan_lite.distributed import free_port

__all__ = ["REPO_ROOT", "captured_log", "free_port", "one_error_line", "read_jsonl", "run_command", "run_distributed",
           "run_main", "run_torchrun", "shutdown_pools"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """The messages the ``torchtitan_lite`` logger emits meanwhile, at INFO as ``python -m
    torchtitan_lite.train`` logs (rank 0's start-up lines included), in a list that fills as they come."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log, handler = logging.getLogger("torchtitan_lite"), Lines()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (e.g. a job's metrics.jsonl)."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_FRESH_SEED = 67280421310721  # the seed of torch's default generator in a new process


def _run_task(fn: Callable[..., Any], rank: int, world_size: int, port: int,
              args: tuple[Any, ...], *, last: bool) -> tuple[str, bytes | str]:
    """Run one task as a fresh rank would: torchrun's variables, one thread, the default RNG,
    and afterwards no process group; unless it is the process's ``last`` task (whose exit hooks
    may still need them), no compiled code and the environment as it was."""
    import torch
    import torch.distributed as dist

    saved_env = dict(os.environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    torch.manual_seed(_FRESH_SEED)
    default_dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return "ok", pickle.dumps(fn(*args))
    except BaseException:  # report everything to the parent
        return "error", traceback.format_exc()
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        from torchtitan_lite.distributed import forget_dtensor_plans

        forget_dtensor_plans()
        if not last:
            torch.set_default_dtype(default_dtype)
            torch.use_deterministic_algorithms(deterministic)
            if "torch._dynamo" in sys.modules:
                sys.modules["torch._dynamo"].reset()
            os.environ.clear()
            os.environ.update(saved_env)


def _worker(rank: int, world_size: int, tasks: Any, results: Any, once: bool) -> None:
    """A long-lived rank: runs tasks until it gets None (importing torch once, not per test);
    with ``once``, exits after the first task, as a torchrun worker would."""
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, port, args = task
        status, payload = _run_task(fn, rank, world_size, port, args, last=once)
        results.put((rank, status, payload))
        if status == "error" or once:  # exit (atexit hooks run): a failed rank's peers see its
            return                      # connections close, as under torchrun


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.checkpoint",
            "torch.distributed.fsdp", "torchtitan_lite.trainer", "torchtitan_lite.train"]
"""What a rank imports before its first task. Ranks are forked from one server process per test
worker that imported these once (``forkserver``: started single-threaded, before any process group
or OpenMP pool exists), so a new rank costs a fork instead of the ~3 CPU-seconds of importing
torch and the trainer. A forked rank ends with ``os._exit`` (no exit hooks), so the ranks of a
``fresh`` call, which end as a torchrun worker does, are spawned interpreters."""


def _context(*, fresh: bool) -> Any:
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Pool:
    """``world_size`` ranks kept alive between tests. Any failure or timeout kills them
    (a rank may be stuck in a collective), and the next call starts new ones."""

    def __init__(self, world_size: int, *, once: bool = False) -> None:
        ctx = _context(fresh=once)
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(rank, world_size, self.tasks[rank], self.results, once),
                                  daemon=True) for rank in range(world_size)]
        for proc in self.procs:
            proc.start()

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)

    def memory(self) -> int:
        """Bytes of anonymous memory its ranks hold (what a test's tensors leave in a rank's heap
        stays there until the process ends)."""
        total = 0
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        total += int(line.split()[1]) * 1024
        return total


_POOLS: dict[int, _Pool] = {}  # by size, the least recently used first
KEPT_POOLS_BYTES = 4 << 30
"""What the kept ranks of one test process may hold between tests: beyond it, the least recently
used pools end (a new rank is a fork of the preloaded server, cheap). Ranks of every size kept at
once, each holding its largest test's heap, ran a 24 GiB machine out of memory in the scenario
tier (the kernel killed a rank mid-test)."""


def _keep(world_size: int, pool: _Pool) -> None:
    _POOLS[world_size] = pool
    while _POOLS and sum(kept.memory() for kept in _POOLS.values()) > KEPT_POOLS_BYTES:
        _POOLS.pop(next(iter(_POOLS))).kill()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 240.0, fresh: bool = False) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function) and should initialise the process
    group itself (e.g. through ``torchtitan_lite.distributed.init_distributed``). The ranks are
    kept for the next call of the same size (so torch is imported once per size, not per
    test); each call gets a new port, the default RNG and a clean environment, and its process
    group is destroyed afterwards. ``fresh=True`` uses new processes that end with the call.
    """
    import queue as queue_mod
    import time

    pool = None if fresh else _POOLS.pop(world_size, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _Pool(world_size, once=fresh)
    port = free_port()
    for tasks in pool.tasks:
        tasks.put((fn, port, args))
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # by rank, a traceback
    deadline = time.monotonic() + timeout
    healthy = False
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout:.0f}s "
                                   f"({len(results)} of {world_size} ranks finished)")
            try:
                rank, status, payload = pool.results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [p for p in pool.procs if not p.is_alive()]
                if dead and not errors:
                    # A rank died without reporting (e.g. a C++ abort): give others a moment.
                    time.sleep(2)
                    if pool.results.empty():
                        raise RuntimeError(
                            f"rank process exited with code {dead[0].exitcode} without a result"
                        ) from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break
        if errors:
            raise RuntimeError("distributed test failed on " + "\n".join(_every_error(pool, results, errors)))
        healthy = True
    finally:
        if healthy and not fresh:
            _keep(world_size, pool)
        else:
            if healthy:  # fresh ranks exit by themselves (running their atexit hooks)
                for proc in pool.procs:
                    proc.join(timeout=30)
            pool.kill()
    return [results[r] for r in range(world_size)]


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _every_error(pool: _Pool, results: dict[int, Any], errors: dict[int, str], wait: float = 10.0) -> list[str]:
    """Every rank's report after the first error: the others' for up to ``wait`` seconds, the
    exit code of a rank that died without one, and the errors that only say a peer went away
    last (the first to arrive is often the one that saw its peer die, not the cause)."""
    import queue as queue_mod
    import time

    silent = set(range(pool.world_size)) - set(errors) - set(results)
    deadline = time.monotonic() + wait
    while silent and time.monotonic() < deadline:
        try:
            rank, status, payload = pool.results.get(timeout=0.5)
        except queue_mod.Empty:
            if not any(pool.procs[r].is_alive() for r in silent):
                break
            continue
        silent.discard(rank)
        if status != "ok":
            errors[rank] = payload
    reports = [f"rank {rank}:\n{text}" for rank, text in errors.items()]
    for rank in sorted(silent):
        code = pool.procs[rank].exitcode
        reports.append(f"rank {rank}: " + ("no report yet (still running)" if code is None
                                          else f"exited with code {code} without a report"))
    return sorted(reports, key=lambda report: any(gone in report for gone in _PEER_GONE))


def shutdown_pools() -> None:
    """Stop the kept ranks (at the end of the test session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        for tasks in pool.tasks:
            tasks.put(None)
        for proc in pool.procs:
            proc.join(timeout=10)
        pool.kill()


def run_torchrun(args: list[str], *, nproc: int, timeout: float = 300.0,
                 cwd: Path | None = None, extra_env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --nproc_per_node=nproc -m torchtitan_lite.train ARGS`` on a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--nnodes=1", "-m", "torchtitan_lite.train", *args]
    return run_command(cmd, timeout=timeout, cwd=cwd, extra_env=extra_env)


def run_command(cmd: list[str], *, timeout: float = 300.0, cwd: Path | None = None,
                extra_env: dict[str, str] | None = None, env: dict[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; kill the whole group on timeout, and whatever of
    it is left when it ends (nothing it started outlives it). ``env``: exactly this environment
    (default: this one without torchrun's variables, one thread, the repository importable, with
    ``extra_env``)."""
    import signal

    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if env is None:
        env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO_ROOT), **(extra_env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd or REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"command timed out after {timeout}s: {cmd}\n{out}\n{err}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_main(cases: list[list[str]], standalone: bool = True) -> list[subprocess.CompletedProcess[str]]:
    """In a rank process of :func:`run_distributed` (torch imported once, not per job): call
    ``torchtitan_lite.train.main(argv)``, which ``python -m torchtitan_lite.train`` runs, for
    each case; return its exit code and everything the job wrote to stderr (file descriptor 2,
    so C++ and logging output too; warnings shown again for each job, as in a new process).

    ``standalone`` drops torchrun's variables, as for a job started without torchrun: each job
    that gets that far creates its own one-process group on a free port. No job may leave a
    process group behind."""
    import tempfile
    import warnings

    import torch.distributed as dist

    from torchtitan_lite.train import main

    if standalone:
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    results = []
    for argv in cases:
        with tempfile.TemporaryFile() as captured, warnings.catch_warnings():
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
            try:
                code = main(argv)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            stderr = captured.read().decode()
        assert not dist.is_initialized(), f"main({argv}) left its process group initialized"
        results.append(subprocess.CompletedProcess(argv, code, "", stderr))
    return results


def one_error_line(result: Any, code: int = 2) -> str:
    """The one ``error:`` line of a job that exited with ``code`` (2: the config, 4: a checkpoint)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), \
        (result.returncode, result.stderr)
    return lines[0]


def refused_lines(argv: list[str], capsys: Any) -> list[str]:
    """``torchtitan_lite.train.main(argv)`` in this process: it must exit 2 without leaving a
    process group; the non-empty lines it wrote to stderr (``capsys``: pytest's fixture)."""
    import torch.distributed as dist

    from torchtitan_lite import train

    assert train.main(argv) == 2
    assert not dist.is_initialized()
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def train_history(argv: list[str]) -> list[dict[str, Any]]:
    """A rank's job: the trainer of ``argv`` trained to its last step; every step's metrics."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    with Trainer(load_job_config(argv)) as trainer:  # (no closing barrier after an error: a peer
        return trainer.train()                         # may be in a collective this rank never joins)
