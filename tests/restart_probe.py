"""``torchrun --max-restarts=1 ... tests/restart_probe.py``: the worst case for a restarted worker
group's process group, made certain. In torchrun's first attempt every rank creates the group
through :func:`torchtitan_lite.distributed.init_distributed` and rank 1 then exits 1. In the
restart, rank 0 creates the group only once rank 1 is about to (a key rank 1 sets in torchrun's
store) and 1 s more, so rank 1 asks for rank 0's address before rank 0 has published one: it
must wait for it rather than be handed the dead attempt's. Each rank prints one line
``attempt <n> rank <r>: all_reduce <sum>``."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from torchtitan_lite.distributed import destroy_distributed, init_distributed


def main() -> int:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt > 0:
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=60))
        if rank == 1:
            agent_store.set(f"restart_probe/{attempt}/rank1", "creating the group")
        elif rank == 0:
            agent_store.wait([f"restart_probe/{attempt}/rank1"])
            time.sleep(1.0)
    init_distributed(torch.device("cpu"), timeout_s=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank}: all_reduce {int(total.item())}", flush=True)
    if attempt == 0 and rank == 1:
        os._exit(1)
    if attempt == 0:
        time.sleep(60)  # until torchrun stops this attempt
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
