"""Eager forward+backward of our Llama model against TorchTitan's, the same shape, in one run:
step time and what each launches (the model alone: no trainer, data or optimizer).

    python scripts/profile_eager.py [--device cuda] [--layers 16] [--seq_len 2048]
                                    [--local_batch_size 4] [--rounds 5] [--steps 3] [--top 15] [--json PATH]

Both models are Llama 3.2 1B's shape (dim 2048, 32 heads, 8 key-value heads, feed-forward
multiplier 1.5, vocabulary 128,256), cut to ``--layers`` blocks, fp32 weights, run under bf16
autocast as each trainer runs one GPU, with the same cross-entropy on the logits. Step times
alternate over ``--rounds`` (medians). Then one step of each is profiled: the number of device
kernels (on CPU: aten ops) and their total time, and the ``--top`` kernels by time. The
difference of the two lists is where an eager gap comes from.

Needs TorchTitan importable (``pip install torchtitan==0.2.2``, or the wheels of
``scripts/gpu_wheels.sh`` on ``PYTHONPATH``; on CPU it also imports ``triton``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchmark import alternating_medians, device_label  # (scripts/benchmark.py, beside this script)

from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS


def _models(layers: int, seq_len: int, device: torch.device) -> dict[str, torch.nn.Module]:
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    ours_args = dataclasses.replace(LLAMA3_FLAVORS["1B"], n_layers=layers, max_seq_len=max(seq_len, 8192))
    theirs_args = TransformerModelArgs(dim=ours_args.dim, n_layers=layers, n_heads=ours_args.n_heads,
                                       n_kv_heads=ours_args.n_kv_heads, vocab_size=ours_args.vocab_size,
                                       multiple_of=ours_args.multiple_of,
                                       ffn_dim_multiplier=ours_args.ffn_dim_multiplier,
                                       rope_theta=ours_args.rope_theta, max_seq_len=seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        ours, theirs = Decoder(ours_args), Transformer(theirs_args)
    with torch.no_grad():  # (TorchTitan's trainer initialises under no_grad too)
        ours.init_weights(device)
        theirs.init_weights(buffer_device=device)
    return {"ours": ours, "torchtitan": theirs}


def _step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)
    return run


def _profile(step: Callable[[], None], device: torch.device, top: int) -> dict[str, Any]:
    """One profiled step: the device's kernels (CPU: the aten ops), their count, total time and
    the ``top`` by time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        time_of: Callable[[Any], float] = lambda e: e.device_time  # noqa: E731
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        time_of = lambda e: e.cpu_time_total  # noqa: E731
    by_name: dict[str, list[float]] = {}
    for event in events:
        by_name.setdefault(event.name, []).append(time_of(event))
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {"kernels": len(events), "total_ms": sum(time_of(e) for e in events) / 1e3,
            "top": [{"name": name[:120], "count": len(times), "ms": round(sum(times) / 1e3, 3)}
                    for name, times in ranked]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default in (("layers", 16), ("seq_len", 2048), ("local_batch_size", 4), ("rounds", 5), ("steps", 3),
                          ("top", 15)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    device = torch.device(opts.device)
    models = _models(opts.layers, opts.seq_len, device)
    generator = torch.Generator().manual_seed(0)
    shape = (opts.local_batch_size, opts.seq_len)
    tokens = torch.randint(0, 128256, shape, generator=generator).to(device)
    labels = torch.randint(0, 128256, shape, generator=generator).to(device)
    steps = {name: _step(model, tokens, labels) for name, model in models.items()}
    times = alternating_medians(steps, opts.rounds, opts.steps, device)
    profiles = {name: _profile(step, device, opts.top) for name, step in steps.items()}
    result = {"device": device_label(device), "torch": torch.__version__, "options": {
        k: v for k, v in vars(opts).items() if k != "json"}, "step_s": times,
        "ours_over_torchtitan_time": times["ours"] / times["torchtitan"], "profiles": profiles}
    unit = "kernels" if device.type == "cuda" else "aten ops"
    print(f"{result['device']}: 1B shape cut to {opts.layers} layers, batch {shape[0]} x {shape[1]}, bf16 autocast")
    for name in models:
        p = profiles[name]
        print(f"  {name:10} {1e3 * times[name]:8.1f} ms per forward+backward; {p['kernels']} {unit}, "
              f"{p['total_ms']:.1f} ms in them")
        for row in p["top"]:
            print(f"      {row['ms']:9.3f} ms {row['count']:5}x  {row['name']}")
    print(f"  ours / TorchTitan time: {result['ours_over_torchtitan_time']:.3f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
