"""Checkpoints moved between expert-parallel degrees, through the real entry point.

    python scripts/resume_across_degrees.py [--families qwen3_moe,deepseek_v3] [--json out.json]

For each family: a tiny random Hugging Face folder made by transformers (Qwen3-MoE: hidden 64,
4 heads, 2 KV heads, head_dim 16, 8 experts of width 32, top-2, 2 layers, vocabulary 300, router
weights with std 0.5; DeepSeek-V3 of the same widths, a dense first layer, 2 expert groups, a
shared expert), trained on 4 CPU ranks (``torchrun``, gloo) in fp32 on random token ids
(``training.dataset = "tokens"``, seq_len 32, global batch 8, local batch 2, 6 steps, a
checkpoint every 3): uninterrupted at expert parallel 1, 2 and 4, then each step-3 checkpoint
resumed at other degrees. Prints the table of steps 4-6 and each resumed row's largest distance
from the uninterrupted run it came from; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MOVES = [(2, 2), (2, 1), (4, 4), (1, 2), (2, 4), (4, 2), (4, 1)]


def hf_folder(family: str, folder: Path) -> Path:
    """A random tiny model of ``family`` saved by transformers."""
    import torch
    import transformers

    common = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "moe_intermediate_size": 32, "num_experts_per_tok": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": False}
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8,
                                             intermediate_size=96, norm_topk_prob=True, router_aux_loss_coef=0.01)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.DeepseekV3Config(**common, num_key_value_heads=4, intermediate_size=128,
                                               kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                                               qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                               n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)
        model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(std=0.5 if name.endswith("gate.weight") else 0.08)
    model.save_pretrained(str(folder))
    return folder


def run(family: str, folder: Path, tokens: Path, dump: Path, ep: int) -> list[float]:
    """One job on 4 ranks through ``torchtitan_lite.train``; its losses."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", _port(),
            "-m", "torchtitan_lite.train", "--model.name", family, "--model.flavor", "from_checkpoint",
            "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
            "--training.dataset", "tokens", "--training.dataset_path", str(tokens), "--training.seq_len", "32",
            "--training.global_batch_size", "8", "--training.local_batch_size", "2", "--training.steps", "6",
            "--lr_scheduler.total_steps", "6", "--training.mixed_precision_param", "float32",
            "--checkpoint.enable", "--checkpoint.interval", "3", "--parallelism.expert_parallel_degree", str(ep),
            "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard",
            "--validation.no-enable"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{family} ep {ep} in {dump} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r]


def _port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def family_table(family: str, work: Path) -> dict[str, Any]:
    import numpy as np

    folder = hf_folder(family, work / "hf")
    tokens = work / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 258, 8 * 33 * 8, dtype=np.uint16))
    whole = {ep: run(family, folder, tokens, work / f"ep{ep}", ep) for ep in (1, 2, 4)}
    rows = [{"run": f"expert parallel {ep}, uninterrupted", "losses": losses[3:]} for ep, losses in whole.items()]
    for source, target in MOVES:
        dump = work / f"ep{source}-to-ep{target}"
        shutil.copytree(work / f"ep{source}" / "checkpoint" / "step-3", dump / "checkpoint" / "step-3")
        losses = run(family, folder, tokens, dump, target)
        reference = whole[source][3:]
        rows.append({"run": f"ep {source}'s step-3 resumed at ep {target}", "losses": losses,
                     "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))})
    return {"family": family, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen3_moe,deepseek_v3")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    tables = []
    with tempfile.TemporaryDirectory(prefix="resume_across_degrees_") as tmp:
        for family in args.families.split(","):
            work = Path(tmp) / family
            work.mkdir()
            table = family_table(family, work)
            tables.append(table)
            print(
                f"\n{family}\n\n| run | step 4 | step 5 | step 6 | largest relative difference |\n|---|---|---|---|---|"
            )
            for row in table["rows"]:
                diff = f"{row['max_rel_diff']:.1e}" if "max_rel_diff" in row else ""
                print(f"| {row['run']} | " + " | ".join(f"{x:.6f}" for x in row["losses"]) + f" | {diff} |")
    if args.json:
        Path(args.json).write_text(json.dumps(tables, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
