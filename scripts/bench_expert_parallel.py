"""Expert parallel against FSDP alone: bytes each rank moves per step and step time, in one run.

    python scripts/bench_expert_parallel.py [--ranks 4] [--steps 6] [--json PATH]

A Qwen3-MoE shape (``--dim``, ``--layers``, ``--experts`` of width ``--hidden``, top ``--top_k``)
trains on the embedded corpus on ``--ranks`` gloo CPU processes (torchrun), fp32, once with the
experts FSDP-sharded over every rank (expert parallel 1) and once per degree in ``--degrees``.
Each rank counts the collectives of its steps after a warm-up step (``scripts/benchmark.py``'s
``CollectiveCounter`` over the ``c10d`` and functional-collective ops) with their unsharded bytes: what each
all-gather delivers
to the rank, what each reduce-scatter or all-reduce takes in, the rows each all-to-all sends
(forward and backward); and times them; rank 0's
figures and the medians of the step times are printed, with the ratios to expert parallel 1.
"""

from __future__ import annotations

import argparse
import dataclasses


def _worker(opts: argparse.Namespace) -> None:
    from benchmark import sweep_worker  # (scripts/benchmark.py, beside this script)

    from torchtitan_lite.models import MODEL_SPECS

    shape = dataclasses.replace(MODEL_SPECS["qwen3_moe"].flavors["tiny"], dim=opts.dim, n_layers=opts.layers,
                                n_heads=8, n_kv_heads=4, head_dim=opts.dim // 8, moe_hidden_dim=opts.hidden,
                                num_experts=opts.experts, top_k=opts.top_k)
    sweep_worker(opts, "qwen3_moe", shape, ["--parallelism.expert_parallel_degree", str(opts.ep)],
                 {"ep": opts.ep, "params": shape.num_params(), "active": shape.active_params()})


def main() -> None:
    from benchmark import sweep, sweep_parser

    opts = sweep_parser(
        __doc__.splitlines()[0],
        {
            "ranks": 4,
            "steps": 6,
            "dim": 256,
            "layers": 4,
            "experts": 16,
            "hidden": 512,
            "top_k": 2,
            "seq_len": 256,
            "local_batch_size": 2,
            "ep": 1,
        },
        "/tmp/bench_expert_parallel",
    ).parse_args()
    if opts.worker:
        _worker(opts)
        return
    sweep(__file__, opts, "ep", ("steps", "dim", "layers", "experts", "hidden", "top_k", "seq_len", "local_batch_size"),
          f"{opts.ranks} ranks, {{params:.1f}}M parameters ({{active:.1f}}M active), {opts.experts} experts "
          f"top-{opts.top_k}, local batch {opts.local_batch_size} x seq {opts.seq_len}, fp32",
          lambda r: r["ep"], "ep")


if __name__ == "__main__":
    main()
