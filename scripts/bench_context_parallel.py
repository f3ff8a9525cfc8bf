"""Context parallel at a long sequence: step time, bytes moved and each rank's attention time, in one run.

    python scripts/bench_context_parallel.py [--ranks 4] [--steps 3] [--seq_len 4096] [--json PATH]

A Llama 3 shape (``--dim``, ``--layers``, ``--heads`` query heads, ``--heads / 2`` key-value heads)
trains on the embedded corpus on ``--ranks`` gloo CPU processes (torchrun), fp32, with the same
global batch (``--global_batch`` sequences of ``--seq_len``) at context parallel 1 (FSDP over every
rank), 2 and 4 with each method (``allgather``, ``ulysses``), and at the largest degree with the
load balance turned off (contiguous chunks). Each rank counts the collectives of its timed steps
(``scripts/benchmark.py``'s ``CollectiveCounter``: FSDP's and context parallel's, unsharded
bytes) and the seconds its attention products take in forward (``scaled_dot_product_attention``
calls, without the collectives); rank 0 prints the median step time, its speed against context
parallel 1, the MiB moved per step by kind, and the balance: the slowest rank's attention time
over the fastest's (1.00: every rank does the same work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any


def _worker(opts: argparse.Namespace) -> None:
    import statistics

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from benchmark import _job_args, timed_collectives  # (scripts/benchmark.py, beside this script)

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.models import MODEL_SPECS, register_model_spec
    from torchtitan_lite.trainer import Trainer

    spec = MODEL_SPECS["llama3"]
    shape = dataclasses.replace(spec.flavors["debugmodel"], dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads,
                                n_kv_heads=opts.heads // 2, max_seq_len=opts.seq_len)
    register_model_spec(dataclasses.replace(spec, flavors={**spec.flavors, "bench": shape}), replace=True)
    dp = opts.ranks // opts.cp
    job = argparse.Namespace(flavor="bench", seq_len=opts.seq_len, local_batch_size=opts.global_batch // dp,
                             dump=opts.dump)
    extra = ["--model.name", "llama3", "--parallelism.context_parallel_degree", str(opts.cp),
             "--parallelism.context_parallel_method", opts.method]
    trainer = Trainer(load_job_config(_job_args(job, *extra)))
    cp = getattr(trainer.model, "context_parallel", None)
    if cp is not None:
        cp.load_balance = not opts.no_balance
    attention = [0.0]
    sdpa = F.scaled_dot_product_attention

    def timed_sdpa(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = sdpa(*args, **kwargs)
        if torch.is_grad_enabled() and not torch._C._current_graph_task_id() >= 0:  # forward only
            attention[0] += time.perf_counter() - start
        return out

    F.scaled_dot_product_attention = timed_sdpa
    try:
        result = timed_collectives(trainer, opts.steps)
        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, attention[0])
        if dist.get_rank() == 0:
            record = {"cp": opts.cp, "dp": dp, "method": opts.method if opts.cp > 1 else "-",
                      "load_balance": not opts.no_balance, "params": shape.num_params(),
                      "attention_s_per_rank": times,
                      "balance": max(times) / max(min(times), 1e-9), "median_attention_s": statistics.median(times)}
            Path(opts.out).write_text(json.dumps({**record, **result}))
    finally:
        F.scaled_dot_product_attention = sdpa
        trainer.close()


def main() -> None:
    from benchmark import run_variants

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in {"ranks": 4, "steps": 3, "dim": 256, "layers": 2, "heads": 4, "seq_len": 4096,
                          "global_batch": 4, "cp": 1}.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--method", default="allgather")
    parser.add_argument("--no_balance", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--dump", default="/tmp/bench_context_parallel")
    opts = parser.parse_args()
    if opts.worker:
        _worker(opts)
        return
    shared = [f"--{k}={getattr(opts, k)}" for k in ("ranks", "steps", "dim", "layers", "heads", "seq_len",
                                                      "global_batch")]
    top = max(d for d in (2, 4) if opts.ranks % d == 0)
    variants = {"cp1": ["--cp=1"]}
    for degree in (2, 4):
        if opts.ranks % degree == 0:
            for method in ("allgather", "ulysses"):
                variants[f"cp{degree}-{method}"] = [f"--cp={degree}", f"--method={method}"]
    variants[f"cp{top}-allgather-contiguous"] = [f"--cp={top}", "--method=allgather", "--no_balance"]
    rows = run_variants(__file__, opts.ranks, {name: [*args, *shared] for name, args in variants.items()}, opts.dump)
    base = rows["cp1"]
    print(f"{opts.ranks} ranks, {base['params'] / 1e6:.1f}M parameters (dim {opts.dim}, {opts.layers} layers, "
          f"{opts.heads} heads), global batch {opts.global_batch} x seq {opts.seq_len}, fp32")
    kinds = sorted({k for r in rows.values() for k in r["mib_per_step"]})
    header = f"{'variant':<26} {'step s':>8} {'speed':>6} " + " ".join(f"{k + ' MiB':>18}" for k in kinds) \
        + f" {'attention s':>12} {'balance':>8}"
    print(header)
    for name, r in rows.items():
        print(f"{name:<26} {r['step_s']:8.3f} {base['step_s'] / r['step_s']:6.2f} "
              + " ".join(f"{r['mib_per_step'].get(k, 0.0):18.2f}" for k in kinds)
              + f" {r['median_attention_s']:12.3f} {r['balance']:8.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
