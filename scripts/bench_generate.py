"""Greedy generation on CPU: our ``DecoderRollouts`` (the training decoder with a KV cache) against
transformers' ``generate`` on the same model, in one run.

    python scripts/bench_generate.py [--dim 256] [--layers 6] [--heads 16] [--kv_heads 4] [--vocab 2048]
                                     [--batch 32] [--new_tokens 64] [--repeats 5] [--threads 2] [--json PATH]

transformers builds a random ``LlamaForCausalLM`` of the given shape (the debug model's by default)
and saves it; our decoder loads it through the Hugging Face import. Both complete the same ``--batch``
prompts of 8 to 64 tokens (left-padded, with an attention mask), greedily, ``--new_tokens`` each
(no EOS: every row runs to the end), fp32, in one process with ``--threads`` threads. Each is run
once to warm up, then ``--repeats`` times, taking turns; the best time counts. Prints each one's generated tokens
per second and the ratio (ours / transformers'), and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def _best(runs: dict[str, Any], repeats: int) -> dict[str, tuple[float, Any]]:
    """Each run's best time over ``repeats`` rounds (after one to warm up), the runs taking turns
    within each round (so that another job's load on the machine meets both alike), and its result."""
    best = {name: (float("inf"), run()) for name, run in runs.items()}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            result = run()
            best[name] = (min(best[name][0], time.perf_counter() - start), result)
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)

    import torch
    import transformers

    from torchtitan_lite.checkpoint import hf_storage
    from torchtitan_lite.models import get_model_spec
    from torchtitan_lite.rl.rollout import DecoderRollouts, SamplingParams

    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=opts.dim, num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
        num_key_value_heads=opts.kv_heads, intermediate_size=4 * opts.dim, vocab_size=opts.vocab,
        max_position_embeddings=512, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.generation_config.eos_token_id = None
    spec = get_model_spec("llama3")
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = spec.model_cls(spec.hf.args_from_config(json.loads((Path(tmp) / "config.json").read_text())))
        hf_storage.load_hf_weights(ours, tmp, spec=spec)
    ours.eval()

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, opts.vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 65, (opts.batch,), generator=g)]
    length = max(map(len, prompts))
    ids = torch.zeros(opts.batch, length, dtype=torch.long)
    mask = torch.zeros(opts.batch, length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, length - len(prompt):] = torch.tensor(prompt)
        mask[i, length - len(prompt):] = 1

    def theirs() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=opts.new_tokens,
                              min_new_tokens=opts.new_tokens, pad_token_id=0)
        return out[:, length:].tolist()

    engine = DecoderRollouts(ours, device=torch.device("cpu"), pad_id=0)
    params = SamplingParams(max_new_tokens=opts.new_tokens, temperature=0.0)

    def ours_run() -> list[list[int]]:
        return [c.token_ids for c in engine.generate(prompts, params, seed=0)]

    timed = _best({"transformers": theirs, "ours": ours_run}, opts.repeats)
    (hf_s, hf_tokens), (ours_s, our_tokens) = timed["transformers"], timed["ours"]
    generated = opts.batch * opts.new_tokens
    report: dict[str, Any] = {
        "model": {"dim": opts.dim, "layers": opts.layers, "heads": opts.heads, "kv_heads": opts.kv_heads,
                  "vocab": opts.vocab, "params": sum(p.numel() for p in ours.parameters())},
        "batch": opts.batch, "prompt_tokens": [min(map(len, prompts)), length], "new_tokens": opts.new_tokens,
        "threads": opts.threads, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_1min": round(os.getloadavg()[0], 2),  # other jobs on the machine meanwhile
        "torch": torch.__version__, "transformers": transformers.__version__,
        "transformers_s": round(hf_s, 4), "transformers_tokens_per_s": round(generated / hf_s, 1),
        "ours_s": round(ours_s, 4), "ours_tokens_per_s": round(generated / ours_s, 1),
        "ratio": round(hf_s / ours_s, 3), "same_tokens": our_tokens == hf_tokens,
    }
    print(f"transformers generate: {report['transformers_tokens_per_s']:8.1f} tokens/s ({hf_s:.3f} s)")
    print(f"DecoderRollouts:       {report['ours_tokens_per_s']:8.1f} tokens/s ({ours_s:.3f} s)")
    print(f"ratio (ours / transformers' tokens/s): {report['ratio']:.3f}; same tokens: {report['same_tokens']}")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
