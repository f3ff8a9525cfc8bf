"""Expert parallel against FSDP alone: bytes each rank moves per step and step time, in one run.

    python scripts/bench_expert_parallel.py [--ranks 4] [--steps 6] [--json PATH]

A Qwen3-MoE shape (``--dim``, ``--layers``, ``--experts`` of width ``--hidden``, top ``--top_k``)
trains on the embedded corpus on ``--ranks`` gloo CPU processes (torchrun), fp32, once with the
experts FSDP-sharded over every rank (expert parallel 1) and once per degree in ``--degrees``.
Each rank counts the collectives of its steps after a warm-up step (``scripts/benchmark.py``'s
``CollectiveCounter`` over the ``c10d`` and functional-collective ops) with their unsharded bytes: what each all-gather delivers
to the rank, what each reduce-scatter or all-reduce takes in, the rows each all-to-all sends
(forward and backward); and times them; rank 0's
figures and the medians of the step times are printed, with the ratios to expert parallel 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def _worker(opts: argparse.Namespace) -> None:
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.models import MODEL_SPECS, register_model_spec
    from torchtitan_lite.trainer import Trainer

    spec = MODEL_SPECS["qwen3_moe"]
    shape = dataclasses.replace(spec.flavors["tiny"], dim=opts.dim, n_layers=opts.layers, n_heads=8, n_kv_heads=4,
                                head_dim=opts.dim // 8, moe_hidden_dim=opts.hidden, num_experts=opts.experts,
                                top_k=opts.top_k)
    register_model_spec(dataclasses.replace(spec, flavors={**spec.flavors, "bench": shape}), replace=True)
    argv = ["--model.name", "qwen3_moe", "--model.flavor", "bench", "--training.seq_len", str(opts.seq_len),
            "--training.local_batch_size", str(opts.local_batch_size), "--training.steps", "1000",
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1000", "--validation.no-enable",
            "--metrics.no-enable_tensorboard", "--job.dump_folder", opts.dump,
            "--parallelism.expert_parallel_degree", str(opts.ep)]
    trainer = Trainer(load_job_config(argv))
    try:
        from benchmark import timed_collectives  # (scripts/benchmark.py, beside this script)

        result = timed_collectives(trainer, opts.steps)
        if dist.get_rank() == 0:
            Path(opts.out).write_text(json.dumps({"ep": opts.ep, **result, "params": shape.num_params(),
                                                  "active": shape.active_params()}))
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("ranks", 4), ("steps", 6), ("dim", 256), ("layers", 4), ("experts", 16), ("hidden", 512),
                          ("top_k", 2), ("seq_len", 256), ("local_batch_size", 2), ("ep", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--degrees", default="2,4")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--dump", default="/tmp/bench_expert_parallel")
    opts = parser.parse_args()
    if opts.worker:
        _worker(opts)
        return
    from benchmark import run_variants

    forwarded = [f"--{k}={getattr(opts, k)}" for k in ("steps", "dim", "layers", "experts", "hidden", "top_k",
                                                         "seq_len", "local_batch_size")]
    degrees = [1, *(int(d) for d in opts.degrees.split(","))]
    rows = list(run_variants(__file__, opts.ranks, {f"ep{ep}": [f"--ep={ep}", *forwarded] for ep in degrees},
                             opts.dump).values())
    base = rows[0]
    print(f"{opts.ranks} ranks, {base['params'] / 1e6:.1f}M parameters ({base['active'] / 1e6:.1f}M active), "
          f"{opts.experts} experts top-{opts.top_k}, local batch {opts.local_batch_size} x seq {opts.seq_len}, fp32")
    kinds = sorted({k for r in rows for k in r["mib_per_step"]})
    print(f"{'ep':>3} {'step s':>8} {'vs ep 1':>8} " + " ".join(f"{k + ' MiB':>18}" for k in kinds) + f" {'total MiB':>10}")
    for r in rows:
        total = sum(r["mib_per_step"].values())
        print(f"{r['ep']:>3} {r['step_s']:8.3f} {base['step_s'] / r['step_s']:8.2f} "
              + " ".join(f"{r['mib_per_step'].get(k, 0.0):18.2f}" for k in kinds) + f" {total:10.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
