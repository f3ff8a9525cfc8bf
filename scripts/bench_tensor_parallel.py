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
    from benchmark import sweep, sweep_parser

    opts = sweep_parser(__doc__.splitlines()[0], {"ranks": 4, "steps": 6, "dim": 512, "layers": 4, "heads": 8, "seq_len": 512,
                                    "global_batch": 4, "tp": 1},
                        "/tmp/bench_tensor_parallel").parse_args()
    if opts.worker:
        _worker(opts)
        return
    sweep(__file__, opts, "tp", ("ranks", "steps", "dim", "layers", "heads", "seq_len", "global_batch"),
          f"{opts.ranks} ranks, {{params:.1f}}M parameters (dim {opts.dim}, {opts.layers} layers, {opts.heads} "
          f"heads), global batch {opts.global_batch} x seq {opts.seq_len}, fp32",
          lambda r: f"{r['dp']} x {r['tp']}", "dp x tp")


if __name__ == "__main__":
    main()
