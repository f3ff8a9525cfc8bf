"""Restarts under ``torchrun --max-restarts``: a restarted worker group's process group never reads
the dead attempt's keys from torchrun's store (pytorch/pytorch#135712), and a job whose rank
was SIGKILLed resumes from its last checkpoint and ends exactly like an uninterrupted run.
(Ten such jobs in a row: ``python scripts/integration_tests.py --test_name restart_after_kill
--repeat 10``.)"""

from __future__ import annotations

import datetime
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import free_port, read_jsonl, run_command, run_distributed


def _torchrun(script: str, *args: str, max_restarts: int, launcher: str = "torch.distributed.run") -> list[str]:
    """A 2-rank launch of ``script`` (or ``-m module``) by ``launcher`` (torchrun, or
    ``torchtitan_lite.launch``, which takes its arguments)."""
    return [sys.executable, "-m", launcher, "--nproc_per_node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", f"--max-restarts={max_restarts}",
            script, *args]


# --------------------------------------------------------------------------------------------
# The attempt's own namespace of the agent's store
# --------------------------------------------------------------------------------------------


def _handshake(port: int, world: int, *, delays: dict[int, float], timeout_s: float = 20.0,
               ranks: list[int] | None = None) -> dict[int, Any]:
    """The store attempt_store gives each of ``ranks`` (default: all), or its exception; each rank
    a thread with its own client, starting after its delay."""
    import torch.distributed as dist

    from torchtitan_lite.distributed.process_group import attempt_store

    out: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        time.sleep(delays.get(rank, 0.0))
        client = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        try:
            store = attempt_store(client, rank=rank, world_size=world, timeout_s=timeout_s, max_poll_s=0.05)
            store.set(f"written-by-{rank}", str(rank))
            out[rank] = store
        except Exception as exc:  # reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


def test_attempt_store_never_hands_out_a_dead_attempts_namespace() -> None:
    """Three attempts on one store, as torchrun's agent keeps it across restarts: in the later
    ones rank 0 comes last, after the other ranks have read the previous attempt's token (and
    acknowledged it). Each attempt still agrees on one namespace, a new one, that holds none of
    the earlier attempts' keys."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    namespaces: list[set[str]] = []
    for attempt, delays in enumerate([{}, {0: 0.5}, {0: 0.5, 2: 0.2}]):
        stores = _handshake(server.port, 3, delays=delays)
        assert not [s for s in stores.values() if isinstance(s, Exception)], (attempt, stores)
        # Each rank's key is visible to the others: one namespace per attempt.
        for store in stores.values():
            assert [store.get(f"written-by-{r}").decode() for r in range(3)] == ["0", "1", "2"]
        keys = {k for k in server.list_keys() if "written-by-" in k}
        prefixes = {k.rsplit("/written-by-", 1)[0] for k in keys} - set().union(*namespaces)
        assert len(prefixes) == 1, (attempt, sorted(keys))
        namespaces.append(prefixes)
    assert len(set().union(*namespaces)) == 3


def test_attempt_store_times_out_naming_the_ranks_that_never_came() -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    stores = _handshake(server.port, 3, delays={}, timeout_s=0.5, ranks=[0])  # ranks 1 and 2 never come
    assert isinstance(stores.get(0), RuntimeError), stores
    assert str(stores[0]) == ("process group: ranks [1, 2] did not join within 0.5 s "
                              "(comm.init_timeout_seconds)")


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_restarted_workers_never_read_the_dead_attempts_addresses() -> None:
    """torchrun keeps one store for all attempts. In the restart, rank 0 creates its group 1 s
    after rank 1 has asked for its address (tests/restart_probe.py): rank 1 must wait for the new
    address, not connect to the dead rank 0's (before the fix: "Gloo connectFullMesh failed ...
    Connection refused" on every run, and the job failed)."""
    result = run_command(_torchrun("tests/restart_probe.py", max_restarts=1), timeout=180)
    output = f"rc={result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    lines = re.findall(r"attempt \d+ rank \d+: \S+ \d+", result.stdout)  # the ranks' prints may interleave
    assert sorted(lines) == [f"attempt {a} rank {r}: all_reduce 2" for a in (0, 1) for r in (0, 1)], output
    assert "Connection refused" not in result.stderr, output


# --------------------------------------------------------------------------------------------
# A job with a killed rank, restarted by torchrun
# --------------------------------------------------------------------------------------------


def _argv(dump: Path) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "10",
            "--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5"]


def _uninterrupted(argv: list[str]) -> list[float]:
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    try:
        return [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.runner  # the runner's restart_after_kill case (kill at step 12 of 30, --repeat N)
def test_max_restarts_resumes_a_killed_rank_and_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """``torchrun --max-restarts=2``, rank 1 SIGKILLed as step 7 of 10 begins, checkpoints every 5:
    the job exits 0; the restarted workers resume from step 5 and log steps 6-10 again, with
    losses bit for bit those of an uninterrupted run (and step 6 those of the killed attempt)."""
    from torchtitan_lite.checkpoint.manager import committed_steps

    dump = tmp_path / "restarted"
    result = run_command(_torchrun("tests/kill_at_step.py", *_argv(dump), max_restarts=2), timeout=300,
                         extra_env={"KILL_RANK": "1", "KILL_AT_STEP": "7"})
    output = f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr, output  # the kill happened
    assert "resumed from" in result.stdout and "step-5 (step 5" in result.stdout, output
    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10], output
    assert committed_steps(dump / "checkpoint") == [5, 10]

    full = run_distributed(_uninterrupted, 2, _argv(tmp_path / "uninterrupted"))[0]
    restarted = [r["loss"] for r in records[6:]]
    assert restarted == full[5:]  # steps 6-10, exactly
    assert records[5]["loss"] == records[6]["loss"] == full[5]
