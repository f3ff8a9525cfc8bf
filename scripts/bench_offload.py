"""Activation offload and tiled feed-forwards on CPU: their step time against full checkpointing
alone, at one sequence length, in one run.

    python scripts/bench_offload.py [--flavor debugmodel] [--seq_len 4096] [--steps 4] [--rounds 2] [--json PATH]

One process, fp32, one sequence a step, full activation checkpointing, four jobs: as is, with the
blocks' inputs offloaded (``activation_checkpoint.offload``), with the dense feed-forwards in
tiles too (``mlp_tiles = 0``: ceil(seq / dim) of them), and with the tiled loss too
(``training.tiled_loss``). Each job's trainer is built once; the
rounds then take ``--steps`` steps of each job in turn (after one warm-up step each), so that a
busy host slows them alike; the median step counts. On a CPU the offload's copies are memory
copies (a GPU's go over PCIe on a side stream: the GPU issue measures those).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_trainers import timed_rounds, trainer_bench_parser, write_rows  # noqa: E402

JOBS = {
    "full checkpointing": [],
    "+ offload": ["--activation_checkpoint.offload"],
    "+ offload + tiled feed-forward": ["--activation_checkpoint.offload", "--activation_checkpoint.mlp_tiles", "0"],
    "+ offload + tiled feed-forward + tiled loss": ["--activation_checkpoint.offload",
                                                     "--activation_checkpoint.mlp_tiles", "0", "--training.tiled_loss"],
}


def main() -> None:
    parser = trainer_bench_parser(__doc__, seq_len=4096)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for index, (name, extra) in enumerate(JOBS.items()):
            argv = ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
                    "--training.local_batch_size", "1", "--training.steps", str(10**6),
                    "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "full",
                    "--validation.no-enable", "--metrics.no-enable_tensorboard", "--job.dump_folder",
                    f"{tmp}/{index}", *extra]
            trainers[name] = Trainer(load_job_config(argv))
            trainers[name].train_step()  # (warm-up)
        times = timed_rounds(trainers, steps=args.steps, rounds=args.rounds)
    base = statistics.median(times["full checkpointing"])
    rows = []
    print(f"{args.flavor}, seq_len {args.seq_len}, one process, fp32, median of {args.steps * args.rounds} steps")
    for name, spent in times.items():
        median = statistics.median(spent)
        rows.append({"job": name, "step_s": round(median, 4), "ratio": round(median / base, 3)})
        print(f"{name:46} {median:8.3f} s  {median / base:6.3f}x")
    write_rows(args, rows)


if __name__ == "__main__":
    main()
