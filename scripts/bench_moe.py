"""Mixture-of-experts feed-forward speed: grouped matrix products (``torch._grouped_mm``) against
the loop over experts, forward + backward, as ratios in one run.

    python scripts/bench_moe.py [--tokens 4096] [--dim 512] [--hidden 1024] [--experts 16] [--top_k 2]
                                [--rounds 5] [--json PATH]

The same weights and tokens for both; each round times ``--steps`` forward+backward passes of each,
alternating, and the medians are reported with their ratio (loop time / grouped time: above 1,
grouped is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from torchtitan_lite.models.moe import MoE, grouped_mm_available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 4096), ("dim", 512), ("hidden", 1024), ("experts", 16), ("top_k", 2),
                          ("rounds", 5), ("steps", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if not grouped_mm_available("cpu"):
        raise SystemExit("torch._grouped_mm does not run on this CPU build")
    torch.manual_seed(0)
    models = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        torch.manual_seed(0)
        model = MoE(opts.dim, opts.hidden, opts.experts, opts.top_k, use_grouped_mm=grouped)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        models[name] = model
    x = torch.randn(1, opts.tokens, opts.dim)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(opts.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(opts.steps):
                out = model(x)
                out.backward(torch.ones_like(out))
                model.zero_grad(set_to_none=True)
            times[name].append((time.perf_counter() - start) / opts.steps)
    grouped, loop = statistics.median(times["grouped"]), statistics.median(times["loop"])
    result = {"shape": vars(opts), "threads": torch.get_num_threads(), "grouped_s": round(grouped, 4),
              "loop_s": round(loop, 4), "loop_over_grouped": round(loop / grouped, 3)}
    print(f"{opts.tokens} tokens, dim {opts.dim}, hidden {opts.hidden}, {opts.experts} experts, top-{opts.top_k}: "
          f"grouped {1e3 * grouped:.1f} ms, loop {1e3 * loop:.1f} ms per forward+backward "
          f"(loop / grouped = {loop / grouped:.2f})")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
