"""Mixture-of-experts feed-forward: grouped matrix products (``torch._grouped_mm``) against the
loop over experts, forward + backward, outputs and speed, as ratios in one run.

    python scripts/bench_moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--tokens 4096]
                                [--dim 512] [--hidden 1024] [--experts 16] [--top_k 2]
                                [--rounds 5] [--steps 3] [--json PATH]

The same weights and tokens for both; the outputs and the weights' gradients of one pass are
compared first (``max_rel_diff``: the largest difference over the largest magnitude, per
tensor), then each round times ``--steps`` forward+backward passes of each, alternating, and the
medians are reported with their ratio (loop time / grouped time: above 1, grouped is faster).
On CUDA the passes are timed between synchronisations and ``--dtype`` defaults to bfloat16 (the
dtype the trainer computes in there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from benchmark import alternating_medians, device_label  # (scripts/benchmark.py, beside this script)

from torchtitan_lite.models.moe import MoE, grouped_mm_available


def _pass(model: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.float().square().mean().backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 4096), ("dim", 512), ("hidden", 1024), ("experts", 16), ("top_k", 2),
                          ("rounds", 5), ("steps", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = getattr(torch, opts.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if not grouped_mm_available(device.type, dtype):
        raise SystemExit(f"torch._grouped_mm does not run on {device.type} in {dtype} with this torch "
                         f"({torch.__version__})")
    models = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        torch.manual_seed(0)
        model = MoE.build(opts.dim, opts.hidden, opts.experts, opts.top_k, use_grouped_mm=grouped)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        models[name] = model.to(device=device, dtype=dtype)
    x = torch.randn(1, opts.tokens, opts.dim, device=device, dtype=dtype)
    (out_g, grads_g), (out_l, grads_l) = _pass(models["grouped"], x), _pass(models["loop"], x)
    diffs = {"output": _max_rel_diff(out_g, out_l),
             "grads": max(_max_rel_diff(g, ref) for g, ref in zip(grads_g, grads_l, strict=True))}

    def step(model: MoE) -> Any:
        def run() -> None:
            out = model(x)
            out.backward(torch.ones_like(out))
            model.zero_grad(set_to_none=True)
        return run

    times = alternating_medians({name: step(model) for name, model in models.items()}, opts.rounds, opts.steps,
                                device)
    grouped, loop = times["grouped"], times["loop"]
    result = {"shape": {k: v for k, v in vars(opts).items() if k != "json"}, "device": device_label(device),
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "max_rel_diff": diffs, "grouped_s": round(grouped, 6),
              "loop_s": round(loop, 6), "loop_over_grouped": round(loop / grouped, 3)}
    print(f"{result['device']}, {result['dtype']}: {opts.tokens} tokens, dim {opts.dim}, hidden {opts.hidden}, "
          f"{opts.experts} experts, top-{opts.top_k}: grouped {1e3 * grouped:.2f} ms, loop {1e3 * loop:.2f} ms "
          f"per forward+backward (loop / grouped = {loop / grouped:.2f}); grouped vs loop: output "
          f"{diffs['output']:.2e}, gradients {diffs['grads']:.2e} (max difference / max magnitude)")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
