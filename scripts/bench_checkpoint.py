"""How long a checkpoint save holds up training: sync against async, in one run.

    torchrun --standalone --nproc_per_node=2 scripts/bench_checkpoint.py [--dim 1024 --n_layers 8]

Builds a sharded Llama model with AdamW state (one real step), then saves it ``--saves`` times
with ``async_mode = "disabled"`` and with ``"async"`` into a temporary folder, alternating the
two. For each save it records the time the training loop was blocked (the ``save`` call) and,
for async saves, the time until the background write was committed. Prints a table (rank 0)
and, with ``--json``, writes the figures there. Works on CPU (gloo) and GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_lite.checkpoint.manager import CheckpointManager
from torchtitan_lite.config import Checkpoint
from torchtitan_lite.distributed import (
    choose_device,
    destroy_distributed,
    fsdp_mesh,
    init_distributed,
    world_info_from_env,
)
from torchtitan_lite.distributed.parallelize import build_sharded_model
from torchtitan_lite.models import get_model_spec


class _PlainState:
    """Stands in for the loader and LR scheduler: only their plain state is saved."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    _, local_rank, world_size = world_info_from_env()
    device = choose_device(local_rank)
    init_distributed(device)
    rank = dist.get_rank()
    mesh = fsdp_mesh(device)
    spec = get_model_spec("llama3")
    model_args = replace(spec.model_args("debugmodel"), dim=args.dim, n_layers=args.n_layers, n_heads=16,
                         vocab_size=args.vocab_size, max_seq_len=64)
    model = build_sharded_model(spec, model_args, mesh, device=device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (1, 64), device=device)
    model(tokens).float().mean().backward()
    optimizer.step()
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + 2 moments

    tmp = tempfile.TemporaryDirectory() if args.folder is None and rank == 0 else None
    folder = [args.folder or (tmp.name if tmp else None)]
    dist.broadcast_object_list(folder)
    managers = {
        mode: CheckpointManager(
            Checkpoint(enable=True, folder=f"ckpt_{mode}", async_mode=mode, keep_latest_k=1),
            dump_folder=folder[0], model=model, optimizer=optimizer, lr_scheduler=_PlainState(),
            loader=_PlainState(), model_spec=spec)
        for mode in ("disabled", "async")
    }
    blocked: dict[str, list[float]] = {"disabled": [], "async": []}
    total: dict[str, list[float]] = {"disabled": [], "async": []}
    for i in range(args.saves):
        for mode, manager in managers.items():
            dist.barrier()
            start = time.perf_counter()
            manager.save(i + 1, {"tokens_seen": 0})
            blocked[mode].append(time.perf_counter() - start)
            manager.wait()
            dist.barrier()
            total[mode].append(time.perf_counter() - start)
    for manager in managers.values():
        manager.close()

    if rank == 0:
        sync_blocked = statistics.median(blocked["disabled"])
        async_blocked = statistics.median(blocked["async"])
        result = {
            "device": str(device), "world_size": world_size,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "state_gib": state_bytes / 2**30,
            "blocked_s": blocked, "total_s": total,
            "median_blocked_sync_s": sync_blocked, "median_blocked_async_s": async_blocked,
            "async_over_sync_blocked": async_blocked / sync_blocked,
        }
        print(f"{result['params_m']:.1f}M parameters, {result['state_gib']:.2f} GiB of model + "
              f"optimizer state, {world_size} ranks on {device.type}")
        print(f"{'mode':<10}{'blocked s (median)':>20}{'until committed s (median)':>30}")
        for mode in ("disabled", "async"):
            print(f"{mode:<10}{statistics.median(blocked[mode]):>20.3f}"
                  f"{statistics.median(total[mode]):>30.3f}")
        print(f"async blocks training for {result['async_over_sync_blocked']:.2f}x the time of a sync save")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.barrier()
    if tmp is not None:
        tmp.cleanup()
    destroy_distributed()


if __name__ == "__main__":
    main()
