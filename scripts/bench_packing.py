"""Chat data: padding of greedy against best-fit decreasing packing, and what finding the
assistant's tokens costs at start-up, in one run.

    python scripts/bench_packing.py [--conversations 2000] [--seq_lens 2048,4096] [--json PATH]

Builds a byte-level BPE tokenizer (a temporary folder) with a ChatML template, and
``--conversations`` conversations of varied shape (1 to 6 exchanges, an optional system message,
turns of 1 to ~400 words drawn from a log-normal), written as JSON lines. Then, for each
``--seq_lens``: the windows and the padding fraction (tokens that are neither a conversation's
nor counted, over all window tokens) of ``training.packing = "greedy"`` and ``"bfd"``. And the
start-up cost per conversation of ``loss_on = "all"`` (render and tokenize), ``"assistant"``
without markers (the turns found by comparing renderings) and ``"assistant"`` with
``{% generation %}`` markers, each the median of 3 rounds, so that the ratios are of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from torchtitan_lite.data import HFTokenizer
from torchtitan_lite.data.chat import packed_windows
from torchtitan_lite.data.windows import PackedWindows

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                 "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the model data train step loss token window rank shard gradient batch layer weight value "
         "attention sequence memory compute checkpoint resume pack turn answer question").split()


def conversations(n: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    rng = np.random.default_rng(seed)

    def text() -> str:
        words = int(np.clip(rng.lognormal(3.5, 1.0), 1, 400))
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=words))

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 7))):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        rows.append({"messages": messages})
    return rows


def write_tokenizer(folder: Path, template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return folder / "tokenizer.json"


def padding(windows: PackedWindows) -> float:
    """The share of the windows' tokens that belong to no conversation."""
    return windows.padding / (len(windows) * (windows.seq_len + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seq_lens", default="2048,4096")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out: dict[str, object] = {"conversations": args.conversations, "packing": {}, "startup": {}}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tokenizer = HFTokenizer(write_tokenizer(root / "tok", CHATML))
        marked = HFTokenizer(write_tokenizer(root / "marked", CHATML_MARKED))
        data = root / "chat.jsonl"
        rows = conversations(args.conversations)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            result = {}
            for how in ("greedy", "bfd"):
                windows = packed_windows([data], tokenizer, seq_len=seq_len - 1, loss_on="all", truncate="right",
                                         key="k", where="w", packing=how)
                result[how] = {"windows": len(windows), "padding_fraction": round(padding(windows), 4)}
            out["packing"][str(seq_len)] = result
            print(f"seq_len {seq_len}: greedy {result['greedy']['windows']} windows, "
                  f"{100 * result['greedy']['padding_fraction']:.1f}% padding; bfd {result['bfd']['windows']} windows, "
                  f"{100 * result['bfd']['padding_fraction']:.1f}% padding")
        sample = [root / "sample.jsonl"]
        sample[0].write_text("".join(json.dumps(r) + "\n" for r in rows[:300]))
        cases = {"all": (tokenizer, "all"), "assistant, no markers": (tokenizer, "assistant"),
                 "assistant, generation markers": (marked, "assistant")}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(3):
            for name, (tok, loss_on) in cases.items():
                start = time.perf_counter()
                packed_windows(sample, tok, seq_len=8191, loss_on=loss_on, truncate="right", key="k", where="w")
                times[name].append((time.perf_counter() - start) / 300)
        base = statistics.median(times["all"])
        for name, values in times.items():
            ms = 1e3 * statistics.median(values)
            out["startup"][name] = {"ms_per_conversation": round(ms, 3), "vs_all": round(ms / 1e3 / base, 2)}
            print(f"{name}: {ms:.2f} ms per conversation ({ms / 1e3 / base:.2f}x loss_on = 'all')")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
