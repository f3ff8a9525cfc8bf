"""Background (async) saves commit as soon as their write finishes, not at the next save, and
their process group takes ``comm.train_timeout_seconds`` once training runs."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed


def _async_run(dump: str) -> dict[str, Any]:
    """10 steps, async saves every 4; before step 9 runs (the next save, which would commit
    step 8 the old way, is at step 10), the ranks wait until step-8 is committed."""
    import torch
    import torch.distributed as dist

    from torchtitan_lite.checkpoint.manager import committed_steps
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config([
        *TINY_ARGS, "--job.dump_folder", dump, "--training.steps", "10", "--checkpoint.enable",
        "--checkpoint.interval", "4", "--checkpoint.async_mode", "async", "--comm.train_timeout_seconds", "37"]))
    checkpointer = trainer.checkpointer
    assert checkpointer is not None
    seen: dict[str, Any] = {}
    step = trainer.train_step

    def watched() -> dict[str, float]:
        if trainer.step == 8:  # step 9 is next; nobody has called wait() since step 8's save
            folder = checkpointer.folder
            deadline = time.monotonic() + 120  # a bound against hanging, not a speed check
            while 8 not in committed_steps(folder) and time.monotonic() < deadline:
                time.sleep(0.02)
            dist.barrier()
            seen["committed_before_step_9"] = committed_steps(folder)
            seen["pending_still_set"] = checkpointer._pending is not None
            groups = checkpointer.process_groups
            seen["save_group_timeouts"] = [g._get_backend(torch.device("cpu")).options._timeout for g in groups]
        return step()

    trainer.train_step = watched
    trainer.train()
    trainer.close()
    return seen


def test_async_save_commits_when_written_and_its_group_takes_the_train_timeout(tmp_path: Path) -> None:
    for rank in run_distributed(_async_run, 2, str(tmp_path / "job")):
        assert rank["committed_before_step_9"] == [4, 8]
        assert rank["pending_still_set"]  # committed without wait(), which the next save calls
        assert rank["save_group_timeouts"] == [datetime.timedelta(seconds=37)]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_a_rank_killed_at_step_9_of_an_async_run_resumes_from_step_8(tmp_path: Path) -> None:
    """Async saves at 4 and 8; rank 1 SIGKILLed as step 9 begins, once step 8's background write
    has been committed (which no later save has to trigger: the wrapper waits at most 60 s for the
    folder, and then kills anyway); the next run resumes from step 8."""
    import sys

    from tests.dist_utils import free_port, run_command

    args = [*TINY_ARGS, "--job.dump_folder", str(tmp_path / "job"), "--training.steps", "12",
            "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode", "async"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                "--rdzv-backend=c10d", "--max-restarts=0"]
    killed = run_command([*torchrun, f"--rdzv-endpoint=127.0.0.1:{free_port()}", "tests/kill_at_step.py", *args],
                         timeout=200, extra_env={"KILL_RANK": "1", "KILL_AT_STEP": "9", "KILL_AFTER_COMMIT": "1"})
    assert killed.returncode != 0 and "exitcode  : -9" in killed.stderr, killed.stderr[-2000:]
    resumed = run_command([*torchrun, f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "torchtitan_lite.train",
                           *args], timeout=200)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {tmp_path / 'job' / 'checkpoint' / 'step-8'} (step 8" in resumed.stdout, resumed.stdout
