"""Chat SFT start-up with the conversation cache: first start (build), second start (reuse), size.

    python scripts/bench_chat_cache.py [--conversations 1000000] [--ranks 2] [--seq_len 2047] [--json PATH]
    python scripts/bench_chat_cache.py --conversations 20000  # 33 MiB of conversations: the same figures, smaller

Writes ``--conversations`` synthetic multi-turn conversations (JSON lines, 1-3 exchanges of
varied length) and a byte-level BPE tokenizer with Llama 3's chat template
(``tests/assets/chat_templates/llama3.jinja``) to a temporary folder, then starts ``--ranks``
processes as torchrun would start the local ranks of one node (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``), each making the packed windows of the source as the trainer does
(``data.chat.packed_windows`` with ``training.chat_cache_dir``): the first start builds the cache
(every rank on its share), the second reads it. Prints both start-up times (the slowest rank),
the cache's size on disk, and what a start without the cache costs (every rank encodes every
conversation: measured on the first 5,000 and scaled).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

_WORDS = ("the model learns from data and every step counts tokens while ranks share work across nodes with "
          "checkpoints saved to disk so that a job resumes exactly where it stopped").split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def write_data(folder: Path, n: int) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    data = folder / "chat.jsonl"
    with data.open("w") as fh:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": _text(rng, 5, 60)},
                             {"role": "assistant", "content": _text(rng, 10, 200)}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_text(rng, 50, 100) for _ in range(2000)], trainer=trainer)
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir()
    tok.save(str(tokenizer / "tokenizer.json"))
    template = (REPO_ROOT / "tests" / "assets" / "chat_templates" / "llama3.jinja").read_text()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": template}))
    return data, tokenizer


def _start(rank: int, ranks: int, data: str, tokenizer: str, cache: str, seq_len: int, out: mp.Queue) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks), MASTER_PORT=str(os.getppid()),
                      TORCHELASTIC_RUN_ID=f"bench-{cache}")
    import torch

    torch.set_num_threads(1)
    from torchtitan_lite.data import HFTokenizer
    from torchtitan_lite.data.chat import packed_windows

    started = time.perf_counter()
    windows = packed_windows([Path(data)], HFTokenizer(Path(tokenizer) / "tokenizer.json"), seq_len=seq_len,
                             loss_on="assistant", truncate="right", key="training.dataset_path", where=data,
                             cache_dir=Path(cache))
    out.put((rank, time.perf_counter() - started, len(windows), windows.describe()))


def start(ranks: int, data: Path, tokenizer: Path, cache: Path, seq_len: int) -> tuple[float, str]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(r, ranks, str(data), str(tokenizer), str(cache), seq_len, out))
             for r in range(ranks)]
    began = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return time.perf_counter() - began, results[0][3]


def without_cache_s(data: Path, tokenizer: Path, n: int, sample: int = 5000) -> float:
    from torchtitan_lite.data import HFTokenizer
    from torchtitan_lite.data.chat import ChatTemplate, conversation

    template = ChatTemplate(HFTokenizer(tokenizer / "tokenizer.json"))
    lines = data.read_text().splitlines()[:sample]
    started = time.perf_counter()
    for line in lines:
        messages, tools = conversation(json.loads(line))
        template.encode(messages, loss_on="assistant", tools=tools)
    return (time.perf_counter() - started) / len(lines) * n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=2047)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    from benchmark import end_on_signals  # (scripts/benchmark.py, beside this script)

    end_on_signals()  # stopped (timeout, a scheduler), it still removes its folder of conversations
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        data, tokenizer = write_data(folder, args.conversations)
        print(f"{args.conversations} conversations written ({data.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        cache = folder / "chat_cache"
        first, described = start(args.ranks, data, tokenizer, cache, args.seq_len)
        print(f"first start ({args.ranks} ranks build the cache): {first:.1f} s; {described}", flush=True)
        second, _ = start(args.ranks, data, tokenizer, cache, args.seq_len)
        print(f"second start (reads it): {second:.1f} s", flush=True)
        size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        print(f"cache size: {size / 2**20:.0f} MiB", flush=True)
        plain = without_cache_s(data, tokenizer, args.conversations)
        print(f"without the cache every rank encodes every conversation: about {plain:.0f} s per start", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "conversations": args.conversations, "ranks": args.ranks, "first_start_s": first,
                "second_start_s": second, "cache_bytes": size, "without_cache_s": plain}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
