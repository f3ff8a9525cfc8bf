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


def _worker(opts: argparse.Namespace) -> None:
    from benchmark import sweep_worker  # (scripts/benchmark.py, beside this script)

    from torchtitan_lite.models import MODEL_SPECS

    shape = dataclasses.replace(MODEL_SPECS["llama3"].flavors["debugmodel"], dim=opts.dim, n_layers=opts.layers,
                                n_heads=opts.heads, n_kv_heads=opts.heads // 2)
    dp = opts.ranks // opts.tp
    sweep_worker(argparse.Namespace(**vars(opts), local_batch_size=opts.global_batch // dp), "llama3", shape,
                 ["--parallelism.tensor_parallel_degree", str(opts.tp)],
                 {"tp": opts.tp, "dp": dp, "params": shape.num_params()})


def main() -> None:
    from benchmark import sweep, sweep_parser

    opts = sweep_parser(
        __doc__.splitlines()[0],
        {"ranks": 4, "steps": 6, "dim": 512, "layers": 4, "heads": 8, "seq_len": 512, "global_batch": 4, "tp": 1},
        "/tmp/bench_tensor_parallel",
    ).parse_args()
    if opts.worker:
        _worker(opts)
        return
    sweep(__file__, opts, "tp", ("ranks", "steps", "dim", "layers", "heads", "seq_len", "global_batch"),
          f"{opts.ranks} ranks, {{params:.1f}}M parameters (dim {opts.dim}, {opts.layers} layers, {opts.heads} "
          f"heads), global batch {opts.global_batch} x seq {opts.seq_len}, fp32",
          lambda r: f"{r['dp']} x {r['tp']}", "dp x tp")


if __name__ == "__main__":
    main()
