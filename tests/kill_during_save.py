"""``torchrun ... tests/kill_during_save.py TRAIN_ARGS``: the trainer's entry point, except that
rank ``KILL_RANK`` SIGKILLs itself while the checkpoint of step ``KILL_AT_STEP`` is being
written (after its own shard files are on disk, before the save is committed)."""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.checkpoint.filesystem import FileSystemWriter

_original_write_data = FileSystemWriter.write_data


def _write_then_die(self, plan, planner):
    future = _original_write_data(self, plan, planner)
    if (os.environ.get("RANK") == os.environ.get("KILL_RANK", "1")
            and f".step-{os.environ['KILL_AT_STEP']}.partial" in str(self.path)):
        future.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return future


FileSystemWriter.write_data = _write_then_die

if __name__ == "__main__":
    from torchtitan_lite.train import main

    sys.exit(main(sys.argv[1:]))
