"""DPO's step on CPU: what the reference's forward costs, and the frozen copy against LoRA's
adapters switched off.

    python scripts/bench_dpo.py [--flavor debugmodel] [--ranks 2] [--seq_len 255] [--steps 6] [--json PATH]

Writes synthetic preference pairs (a prompt of 5-60 words, answers of 10-120) and a byte-level
BPE tokenizer with Llama 3's chat template (:func:`bench_chat_cache.write_data`), then trains the
model with ``training.dataset = "preference"`` on ``--ranks`` gloo processes, fp32, twice: a full
fine-tune with a frozen copy as the reference, and LoRA (rank 16 on the attention) with its adapters
switched off. Each step's reference forward (the forward that runs without gradients, timed by hooks
on the copy or the model) is set against the whole step, after two warm-up steps; the slowest rank counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))


def write_pairs(folder: Path, n: int) -> tuple[Path, Path]:
    from bench_chat_cache import _text, write_data

    _, tokenizer = write_data(folder, 10)
    rng = random.Random(1)
    pairs = folder / "pairs.jsonl"
    with pairs.open("w") as fh:
        for _ in range(n):
            prompt = [{"role": "user", "content": _text(rng, 5, 60)}]
            fh.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": _text(rng, 10, 120)}],
                                 "rejected": [{"role": "assistant", "content": _text(rng, 10, 120)}]}) + "\n")
    return pairs, tokenizer

from bench_ranks import run_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, argv: list[str], steps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    # The reference's forward is the one that runs without gradients (a frozen copy, or the model
    # with its adapters off): timed by hooks on whichever module runs it.
    spent, began = [0.0], []
    runs_it = trainer.objective.reference if trainer.objective.reference is not None else trainer.model
    runs_it.register_forward_pre_hook(lambda *_: began.append(time.perf_counter()))
    runs_it.register_forward_hook(lambda *_: spent.__setitem__(
        0, spent[0] + (time.perf_counter() - began.pop()) * (not torch.is_grad_enabled())))
    rows = []
    for _ in range(steps):
        spent[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        rows.append((time.perf_counter() - start, spent[0]))
    trainer.close()
    out.put((rank, rows[2:]))


def _run(argv: list[str], ranks: int, steps: int) -> dict[str, float]:
    results = run_ranks(_rank, ranks, argv, steps, timeout=1200)
    by_step = [max((rows[i] for _, rows in results), key=lambda r: r[0]) for i in range(steps - 2)]
    step_s = sum(r[0] for r in by_step) / len(by_step)
    reference_s = sum(r[1] for r in by_step) / len(by_step)
    return {"step_s": round(step_s, 4), "reference_forward_s": round(reference_s, 4),
            "reference_share": round(reference_s / step_s, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=255)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pairs, tokenizer = write_pairs(Path(tmp), 64)
        common = ["--model.flavor", opts.flavor, "--model.tokenizer_path", str(tokenizer),
                  "--training.dataset", "preference", "--training.dataset_path", str(pairs),
                  "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", "2",
                  "--training.steps", str(opts.steps), "--training.mixed_precision_param", "float32",
                  "--validation.no-enable", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000"]
        report: dict[str, Any] = {"flavor": opts.flavor, "ranks": opts.ranks, "seq_len": opts.seq_len,
                                  "pairs_per_rank_per_step": 2}
        report["copy"] = _run([*common, "--job.dump_folder", f"{tmp}/copy"], opts.ranks, opts.steps)
        report["adapters_off"] = _run([*common, "--job.dump_folder", f"{tmp}/lora", "--lora.enable"], opts.ranks,
                                      opts.steps)
    for name in ("copy", "adapters_off"):
        r = report[name]
        print(f"{name:13} step {r['step_s']:.3f} s, reference forward {r['reference_forward_s']:.3f} s "
              f"({100 * r['reference_share']:.1f}% of the step)")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
