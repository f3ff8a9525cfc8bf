"""``torchrun [--max-restarts=N] ... tests/kill_at_step.py TRAIN_ARGS``: the trainer's entry point,
except that rank ``KILL_RANK`` (default 1) SIGKILLs itself as step ``KILL_AT_STEP`` begins, in
torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so that the workers torchrun
restarts train to the end. Without ``KILL_AT_STEP`` it is the plain entry point.

Before dying it waits (at most 60 s) until rank 0 has logged the step before to
``<dump_folder>/metrics.jsonl``: the kill then always lands while rank 0 is in step
``KILL_AT_STEP``, and a resumed run logs the steps after its checkpoint a second time. With
``KILL_AFTER_COMMIT`` set it also waits (within the same 60 s) until the step before is a
committed checkpoint folder. ``KILL_SIGNAL`` names another signal than SIGKILL (e.g. SIGTERM, for
preemption); ``KILL_TARGET`` = ``agent`` sends it to the rank's launcher instead, ``agent_group``
to the launcher's process group (the workers, in sessions of their own, hear it from the
launcher); with ``SIGNAL_DURING_SAVE`` the rank also sends it to itself again as each
checkpoint save begins. With ``KILL_NODE`` set the rank SIGKILLs its torchrun agent first (a
whole loopback node lost: the agent's other ranks end with it). Used by
tests/test_process_group_restarts.py, tests/test_preemption.py, tests/test_job_locks.py and the
integration runner's ``restart_after_kill``, ``node_killed_two_loopback_nodes`` and
``stopped_rank`` cases."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_lite.checkpoint.manager import CheckpointManager
from torchtitan_lite.trainer import Trainer

_original_train_step = Trainer.train_step
_original_save = CheckpointManager.save


def _logged(metrics: Path, step: int) -> bool:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return False
    return any(json.loads(line).get("step") == step for line in lines if line.strip())


def _train_step_or_die(self: Trainer) -> dict[str, float]:
    if (os.environ.get("KILL_AT_STEP") and self.step + 1 == int(os.environ["KILL_AT_STEP"])
            and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1")
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        metrics = Path(self.config.job.dump_folder) / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while not _logged(metrics, self.step) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.environ.get("KILL_AFTER_COMMIT"):  # and until the step before is a committed checkpoint
            committed = Path(self.config.job.dump_folder) / self.config.checkpoint.folder / f"step-{self.step}"
            while not committed.is_dir() and time.monotonic() < deadline:
                time.sleep(0.05)
        if os.environ.get("KILL_NODE"):  # the whole node: its agent first (its other ranks follow it)
            os.kill(os.getppid(), signal.SIGKILL)
        sig = signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")]
        target = os.environ.get("KILL_TARGET", "self")
        if target == "agent":  # the launcher alone, as `kill PID` does
            os.kill(os.getppid(), sig)
        elif target == "agent_group":  # the launcher's process group, as Slurm or a shell's job control does
            os.killpg(os.getpgid(os.getppid()), sig)
        else:
            os.kill(os.getpid(), sig)
    return _original_train_step(self)


def _save_and_signal(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
    if os.environ.get("SIGNAL_DURING_SAVE") and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1"):
        os.kill(os.getpid(), signal.Signals[os.environ.get("KILL_SIGNAL", "SIGKILL")])
    return _original_save(self, *args, **kwargs)


Trainer.train_step = _train_step_or_die
CheckpointManager.save = _save_and_signal

if __name__ == "__main__":
    from torchtitan_lite.train import main

    sys.exit(main(sys.argv[1:]))
