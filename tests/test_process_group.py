"""Process-group life cycle: when a rank dies or hangs, the others exit with an error in time; at a
clean exit the groups are freed while Python is still alive; the backend string for each device;
a second run in one process builds its mesh on its own groups."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, free_port, run_distributed
from tests.test_fsdp_units import VOCAB, MyModel

TRAIN_TIMEOUT = 5  # seconds
INIT_TIMEOUT = 300  # seconds: comm.init_timeout_seconds's default, which the survivor must not wait for
EXIT_MARGIN = 60  # seconds the survivor may take beyond TRAIN_TIMEOUT to exit on a loaded 2-core machine


def _start_ranks(dump: Path, world: int = 2) -> list[subprocess.Popen[str]]:
    """The trainer on ``world`` processes started by hand (as torchrun would, without its agent,
    which would otherwise stop the survivors itself)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        cmd = [sys.executable, "-m", "torchtitan_lite.train", *TINY_ARGS, "--job.dump_folder", str(dump),
               "--training.steps", "100000", "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT)]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True))
    return procs


def _wait_for_step(dump: Path, step: int, procs: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    """Wait until the metrics file shows ``step`` (a hang guard, not a time limit: a loaded machine
    has taken over 120 s to start two ranks and reach step 3)."""
    metrics = dump / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            lines = [line for line in metrics.read_text().splitlines() if line.strip()]
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a rank exited early with {dead}: {procs[0].stderr.read() if procs[0].stderr else ''}"
        time.sleep(0.2)
    raise AssertionError(f"training did not reach step {step} within {timeout}s")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", pytest.param("hung", marks=pytest.mark.scenario)])
def test_survivor_exits_with_an_error_within_the_train_timeout(tmp_path, how):
    """Rank 1 is SIGKILLed (or SIGSTOPped: alive but silent) mid-training; rank 0 must exit
    non-zero within comm.train_timeout_seconds (+ EXIT_MARGIN for this 2-core machine) instead of
    hanging for the 300 s init timeout or forever."""
    assert TRAIN_TIMEOUT + EXIT_MARGIN < INIT_TIMEOUT  # the hang bound tells the two timeouts apart
    dump = tmp_path / how
    procs = _start_ranks(dump)
    try:
        _wait_for_step(dump, 3, procs)
        victim = procs[1]
        victim.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        try:
            # Hang bound: the train timeout plus a wide margin, well below the init timeout.
            rc = procs[0].wait(timeout=TRAIN_TIMEOUT + EXIT_MARGIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {TRAIN_TIMEOUT + EXIT_MARGIN}s (comm.train_timeout_seconds "
                        f"{TRAIN_TIMEOUT} + margin {EXIT_MARGIN}) after rank 1 was {how}")
        elapsed = time.monotonic() - start
        stderr = procs[0].stderr.read() if procs[0].stderr else ""
        print(f"rank 1 {how}: rank 0 exited with {rc} after {elapsed:.1f}s")
        assert rc != 0, stderr[-2000:]
        if how == "hung":
            # Nothing told rank 0 that its peer was gone: the collective's timeout did (its
            # message says so).
            assert "Timed out" in stderr or "timed out" in stderr or "Timeout" in stderr, stderr[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _threads_until_exit(out: str) -> dict[str, int]:
    """Threads of this rank before the group exists, after FSDP training (with DTensor's
    gradient-norm reduction) and a gathered result, and after ``destroy_distributed``. An exit
    hook registered before ``init_distributed`` runs after the one it registers (``atexit`` is
    last-in, first-out) and writes the count at exit to ``out``."""
    import atexit

    import torch
    import torch.distributed as dist

    from torchtitan_lite.distributed import destroy_distributed, fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    atexit.register(lambda: Path(out, f"rank{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}")
                    .write_text(str(threads())))
    counts = {"before": threads()}
    device = torch.device("cpu")
    init_distributed(device)
    spec = get_model_spec("llama3")
    model = build_sharded_model(spec, spec.model_args("tiny"), fsdp_mesh(device), device=device, seed=0)
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank()})
    counts["trained"] = threads()
    del model
    destroy_distributed()
    counts["destroyed"] = threads()
    return counts


@pytest.mark.slow
def test_process_groups_are_freed_at_exit_before_python_shuts_down(tmp_path):
    """Meshes in DTensor's caches keep a destroyed group and its gloo threads alive; the exit hook
    that ``init_distributed`` registers frees them while Python is still alive. Without it, a gloo
    thread could drop a collective's tensor during shutdown and abort a process whose work was
    done (SIGABRT, "terminate called without an active exception")."""
    for rank, counts in enumerate(run_distributed(_threads_until_exit, 2, str(tmp_path), fresh=True)):
        assert counts["trained"] > counts["before"], counts
        assert counts["destroyed"] == counts["trained"], counts  # destroyed, but its threads run on
        assert int((tmp_path / f"rank{rank}").read_text()) == counts["before"], counts


_FAILING_JOB = """
import atexit, os, sys
from torchtitan_lite import train, trainer
def threads():
    return len(os.listdir("/proc/self/task"))
print("threads before", threads(), flush=True)
atexit.register(lambda: print("threads at exit", threads(), flush=True))
def fail(self):
    raise RuntimeError("failed in step 1")
trainer.Trainer.train_step = fail
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_job_that_fails_with_a_traceback_still_frees_its_process_group_at_exit(tmp_path):
    """An uncaught error leaves its traceback in ``sys.last_*``, whose frames hold the trainer and
    through it the group; the exit hook drops it, so the gloo threads are joined here too and the
    job exits with Python's 1, not an abort."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _FAILING_JOB, *TINY_ARGS, "--job.dump_folder", str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "RuntimeError: failed in step 1" in done.stderr, done.stderr[-2000:]
    counts = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines() if line.startswith("threads "))
    assert counts["threads at exit"] == counts["threads before"], done.stdout


# --------------------------------------------------------------------------------------------
# The backend string
# --------------------------------------------------------------------------------------------


def test_backend_for():
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from torchtitan_lite.distributed import backend_for

    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cpu"), cpu_collectives=True) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    mixed = backend_for(torch.device("cuda", 0), cpu_collectives=True)
    assert mixed == "cuda:nccl,cpu:gloo"
    # torch itself parses it into a CPU and a CUDA backend.
    assert BackendConfig(Backend(mixed)).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    with pytest.raises(ValueError, match="unsupported device type"):
        backend_for(torch.device("meta"))


# --------------------------------------------------------------------------------------------
# A second run in the same process
# --------------------------------------------------------------------------------------------


def _two_hsdp_runs_in_one_process() -> list[float]:
    """Two HSDP 2 × 2 runs one after the other in one process, each with its own process group
    (the second on a port the first agreed on) and gradient clipping; returns the grad norms.
    The first run makes one more group before its mesh, so the two meshes' groups have
    different names (as after any earlier job that made a different number of groups)."""
    import os

    import torch.distributed as dist

    from torchtitan_lite.distributed import ParallelDims, build_mesh, free_port, init_distributed
    from torchtitan_lite.distributed.clip import clip_grad_norm_
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    norms = []
    for run in range(2):
        init_distributed(torch.device("cpu"))
        if run == 0:
            dist.new_group(list(range(4)))
        mesh = build_mesh(torch.device("cpu"), ParallelDims.resolve(dp_replicate=2, dp_shard=2, world_size=4)).fsdp
        torch.manual_seed(0)
        model = MyModel()
        apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=model.head)
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        norms.append(float(clip_grad_norm_(list(model.parameters()), 1.0)))
        port = [free_port() if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        dist.barrier()
        dist.destroy_process_group()  # not destroy_distributed: as research code might
        os.environ["MASTER_PORT"] = str(port[0])
    return norms


@pytest.mark.slow
def test_second_hsdp_run_in_one_process_does_not_reuse_the_first_runs_groups():
    """DTensor caches sharding plans by mesh layout; a new mesh of the same shape must not be
    handed the first mesh's (destroyed) process groups."""
    for first, second in run_distributed(_two_hsdp_runs_in_one_process, 4):
        assert math.isfinite(first) and first == pytest.approx(second, rel=1e-6)
