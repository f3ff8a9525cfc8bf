"""The optimizer step on sharded parameters: ours (the shards' local tensors) against
``torch.optim`` dispatching through DTensor, in one run.

    python scripts/bench_optimizer_step.py [--flavor debugmodel] [--ranks 2] [--steps 6] [--json PATH]

Starts ``--ranks`` gloo processes (one thread each). Each builds the model twice from the same
seed, FSDP2-sharded over every rank, with AdamW (foreach) over each copy: ours
(:func:`torchtitan_lite.optim.build_optimizer`) and ``torch.optim.AdamW`` with the same parameter
groups and hyperparameters. Every step runs a forward and backward on both copies, then times
each optimizer's ``step`` (the slowest rank's): the first step (Adam makes its state and, through
DTensor, works out the sharding of every foreach op) and the mean of the later ones. Prints both
and their ratios, and checks that the two copies stay bit for bit equal.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def _rank(rank: int, world: int, port: int, flavor: str, steps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from torchtitan_lite.config import Optimizer
    from torchtitan_lite.distributed import destroy_distributed, fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.models import get_model_spec
    from torchtitan_lite.optim import build_optimizer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_distributed(device)
    spec = get_model_spec("llama3")
    args = spec.model_args(flavor)
    mesh = fsdp_mesh(device)
    models = {who: build_sharded_model(spec, args, mesh, device=device, seed=0) for who in ("ours", "torch")}
    ours = build_optimizer(models["ours"], Optimizer(name="AdamW", lr=1e-3, weight_decay=0.1))
    twin = dict(zip(map(id, models["ours"].parameters()), models["torch"].parameters(), strict=True))
    theirs = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [twin[id(p)] for p in g["params"]]} for g in ours.param_groups])
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (2, 128), generator=gen)
        for who, optimizer in (("ours", ours), ("torch", theirs)):
            models[who](tokens).float().square().mean().backward()
            dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            times[who].append(time.perf_counter() - start)
            optimizer.zero_grad(set_to_none=True)
    equal = all(torch.equal(a.to_local(), b.to_local())
                for a, b in zip(models["ours"].parameters(), models["torch"].parameters(), strict=True))
    destroy_distributed()
    out.put((rank, times, equal))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    from torchtitan_lite.distributed import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, opts.ranks, port, opts.flavor, opts.steps, out))
             for r in range(opts.ranks)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    slowest = {who: [max(times[who][i] for _, times, _ in results) for i in range(opts.steps)]
               for who in ("ours", "torch")}
    report = {"flavor": opts.flavor, "ranks": opts.ranks, "steps": opts.steps,
              "bit_for_bit": all(equal for *_, equal in results)}
    for who, times in slowest.items():
        report[f"{who}_first_ms"] = round(1e3 * times[0], 2)
        report[f"{who}_later_ms"] = round(1e3 * sum(times[1:]) / max(1, len(times) - 1), 2)
    report["first_speedup"] = round(report["torch_first_ms"] / report["ours_first_ms"], 2)
    report["later_speedup"] = round(report["torch_later_ms"] / report["ours_later_ms"], 2)
    print(f"AdamW step, {opts.flavor}, {opts.ranks} ranks (slowest rank): first {report['ours_first_ms']} ms "
          f"against torch.optim's {report['torch_first_ms']} ms ({report['first_speedup']}x); later "
          f"{report['ours_later_ms']} ms against {report['torch_later_ms']} ms ({report['later_speedup']}x); "
          f"bit for bit: {report['bit_for_bit']}")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["bit_for_bit"] else 1


if __name__ == "__main__":
    sys.exit(main())
