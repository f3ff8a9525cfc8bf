"""Block-causal attention of packed documents: FlexAttention (compiled, a ``BlockMask`` that skips
the blocks no token of a document sees) against the dense-mask path (``scaled_dot_product_attention``
with a ``(bs, 1, seq, seq)`` boolean mask), logits and speed, in one run.

    python scripts/bench_flex.py [--device cuda] [--flavor 1B] [--layers 4] [--seq_len 2048]
                                 [--local_batch_size 4] [--mean_doc_len 512] [--rounds 5] [--steps 3]
                                 [--json PATH]

The model is the llama3 ``--flavor`` cut to ``--layers`` blocks, fp32 weights; each row of the
batch packs documents of random lengths (exponential around ``--mean_doc_len``). Logits: the fp32
dense-mask forward is the reference; the two paths run under bf16 autocast (as the trainer runs
them on one GPU) and each one's error is ``max |logits - reference| / max |reference|``. The flex
path passes when its error is at most 1.5× the dense path's + 1e-3 (bf16 rounding, not a wrong
mask: a token that sees the wrong document moves its logits by far more). Speed: forward+backward
of the whole cut model, and of one attention call (forward only on CPU, where FlexAttention has no backward)
at the flavor's head shape, each path
alternating over ``--rounds``, medians (and plain causal attention, no documents, for scale).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark import alternating_medians, device_label  # (scripts/benchmark.py, beside this script)

import torchtitan_lite.models.decoder as decoder
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS


@contextlib.contextmanager
def _mask_path(flex: bool) -> Iterator[None]:
    """The decoder builds its block-causal mask as ``flex`` says (its default: flex on CUDA)."""
    original = decoder.block_causal_mask
    decoder.block_causal_mask = functools.partial(original, flex=flex)
    try:
        yield
    finally:
        decoder.block_causal_mask = original


def _document_ids(batch: int, seq_len: int, mean_len: int, generator: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq_len:
            lengths.append(max(1, int(torch.empty(1).exponential_(1 / mean_len, generator=generator))))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq_len])
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--flavor", default="1B", choices=sorted(LLAMA3_FLAVORS))
    for name, default in (("layers", 4), ("seq_len", 2048), ("local_batch_size", 4), ("mean_doc_len", 512),
                          ("rounds", 5), ("steps", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = torch.bfloat16

    args = dataclasses.replace(LLAMA3_FLAVORS[opts.flavor], n_layers=opts.layers,
                               max_seq_len=max(opts.seq_len, LLAMA3_FLAVORS[opts.flavor].max_seq_len))
    torch.manual_seed(0)
    with torch.device(device):
        model = decoder.Decoder(args)
    model.init_weights(device)
    generator = torch.Generator().manual_seed(0)
    docs = _document_ids(opts.local_batch_size, opts.seq_len, opts.mean_doc_len, generator).to(device)
    tokens = torch.randint(0, args.vocab_size, (opts.local_batch_size, opts.seq_len), generator=generator).to(device)
    dense_mask = decoder.block_causal_mask(docs, flex=False).dense()
    density = float(dense_mask.float().mean() / torch.ones(opts.seq_len, opts.seq_len).tril().mean())

    with torch.no_grad():
        with _mask_path(flex=False):
            reference = model(tokens, docs).float()
        scale = float(reference.abs().max())
        errors = {}
        for label, flex in (("flex", True), ("dense", False)):
            with _mask_path(flex=flex), torch.autocast(device.type, dtype=dtype):
                errors[label] = float((model(tokens, docs).float() - reference).abs().max()) / scale
        del reference
    logits_ok = errors["flex"] <= 1.5 * errors["dense"] + 1e-3

    backward = device.type != "cpu"  # FlexAttention has no CPU backward: forward only there

    def model_step(flex: bool) -> Callable[[], None]:
        def step() -> None:
            with _mask_path(flex=flex), torch.autocast(device.type, dtype=dtype), torch.set_grad_enabled(backward):
                logits = model(tokens, docs)
            if backward:
                logits.float().mean().backward()
                model.zero_grad(set_to_none=True)
        return step

    model_times = alternating_medians({"flex": model_step(True), "dense": model_step(False)}, opts.rounds,
                                      opts.steps, device)

    heads, kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
    head_dim = args.dim // heads
    shape = (opts.local_batch_size, opts.seq_len, head_dim)
    q = torch.randn(shape[0], heads, shape[1], shape[2], device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(shape[0], kv_heads, shape[1], shape[2], device=device, dtype=dtype, requires_grad=backward)
            for _ in range(2))
    block_mask = decoder.block_causal_mask(docs, flex=True)
    flex_attention = decoder.compiled_flex_attention()

    def attention(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            out = fn()
            if backward:
                out.sum().backward()
        return step

    attention_times = alternating_medians({
        "flex": attention(lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)),
        "dense": attention(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, enable_gqa=True)),
        "causal, no documents": attention(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                enable_gqa=True)),
    }, opts.rounds, opts.steps, device)

    name = device_label(device)
    result = {
        "device": name,
        "torch": torch.__version__,
        "options": {k: v for k, v in vars(opts).items() if k != "json"},
        "documents_per_row": [int(row.max()) + 1 for row in docs.cpu()],
        "mask_density_vs_causal": round(density, 4),
        "logit_error": errors,
        "logits_ok": logits_ok,
        "timed": "forward+backward" if backward else "forward",
        "model_fwd_bwd_s": model_times,
        "model_dense_over_flex": model_times["dense"] / model_times["flex"],
        "attention_fwd_bwd_s": attention_times,
        "attention_dense_over_flex": attention_times["dense"] / attention_times["flex"],
    }
    print(f"{name}: {opts.flavor} cut to {opts.layers} layers, batch {opts.local_batch_size} x {opts.seq_len}, "
          f"{result['documents_per_row']} documents per row (mask {density:.0%} of causal)")
    print(f"  logits vs fp32 dense: flex {errors['flex']:.2e}, dense {errors['dense']:.2e} "
          f"({'ok' if logits_ok else 'FLEX OFF BY MORE THAN bf16'})")
    print(
        f"  model {result['timed']}: flex {1e3 * model_times['flex']:.1f} ms, "
        f"dense {1e3 * model_times['dense']:.1f} ms "
        f"(dense / flex {result['model_dense_over_flex']:.2f})"
    )
    print(f"  attention {result['timed']}: " + ", ".join(f"{k} {1e3 * t:.2f} ms" for k, t in attention_times.items())
          + f" (dense / flex {result['attention_dense_over_flex']:.2f})")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")
    if not logits_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
