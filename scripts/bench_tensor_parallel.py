"""Tensor parallel (2-D, FSDP × TP) against FSDP alone: step time and collectives, in one run.

    python scripts/bench_tensor_parallel.py [--ranks 4] [--steps 6] [--degrees 2,4] [--json PATH]

A Llama 3 shape (``--dim``, ``--layers``, ``--heads`` query heads and ``--heads / 2`` key-value
heads, feed-forward ``--ffn_dim_multiplier`` as the flavors compute it) trains on the embedded
corpus on ``--ranks`` gloo CPU processes (torchrun), fp32, once with FSDP over every rank (tensor
parallel 1) and once per degree in ``--degrees`` (data parallel ``ranks / degree`` × tensor
parallel ``degree``, sequence and loss parallel), with the same global batch (``--global_batch``
sequences of ``--seq_len``). Each rank counts the collectives of its steps after a warm-up step
(``scripts/benchmark.py``'s ``CollectiveCounter``, unsharded bytes) and times them; rank 0's
figures, the medians of the step times and their ratios to FSDP alone are printed.
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

    spec = MODEL_SPECS["llama3"]
    shape = dataclasses.replace(spec.flavors["debugmodel"], dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads,
                                n_kv_heads=opts.heads // 2)
    register_model_spec(dataclasses.replace(spec, flavors={**spec.flavors, "bench": shape}), replace=True)
    dp = opts.ranks // opts.tp
    argv = ["--model.name", "llama3", "--model.flavor", "bench", "--training.seq_len", str(opts.seq_len),
            "--training.local_batch_size", str(opts.global_batch // dp), "--training.steps", "1000",
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1000", "--validation.no-enable",
            "--metrics.no-enable_tensorboard", "--job.dump_folder", opts.dump,
            "--parallelism.tensor_parallel_degree", str(opts.tp)]
    trainer = Trainer(load_job_config(argv))
    try:
        from benchmark import timed_collectives  # (scripts/benchmark.py, beside this script)

        result = timed_collectives(trainer, opts.steps)
        if dist.get_rank() == 0:
            Path(opts.out).write_text(json.dumps({"tp": opts.tp, "dp": dp, **result, "params": shape.num_params()}))
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("ranks", 4), ("steps", 6), ("dim", 512), ("layers", 4), ("heads", 8), ("seq_len", 512),
                          ("global_batch", 4), ("tp", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--degrees", default="2,4")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--dump", default="/tmp/bench_tensor_parallel")
    opts = parser.parse_args()
    if opts.worker:
        _worker(opts)
        return
    from benchmark import run_variants

    forwarded = [f"--{k}={getattr(opts, k)}" for k in ("ranks", "steps", "dim", "layers", "heads", "seq_len",
                                                         "global_batch")]
    degrees = [1, *(int(d) for d in opts.degrees.split(","))]
    rows = list(run_variants(__file__, opts.ranks, {f"tp{tp}": [f"--tp={tp}", *forwarded] for tp in degrees},
                             opts.dump).values())
    base = rows[0]
    print(f"{opts.ranks} ranks, {base['params'] / 1e6:.1f}M parameters (dim {opts.dim}, {opts.layers} layers, "
          f"{opts.heads} heads), global batch {opts.global_batch} x seq {opts.seq_len}, fp32")
    kinds = sorted({k for r in rows for k in r["mib_per_step"]})
    print(f"{'dp x tp':>8} {'step s':>8} {'vs FSDP':>8} " + " ".join(f"{k + ' MiB':>18}" for k in kinds)
          + f" {'total MiB':>10}")
    for r in rows:
        total = sum(r["mib_per_step"].values())
        print(f"{r['dp']:>4} x {r['tp']:<1} {r['step_s']:8.3f} {base['step_s'] / r['step_s']:8.2f} "
              + " ".join(f"{r['mib_per_step'].get(k, 0.0):18.2f}" for k in kinds) + f" {total:10.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
