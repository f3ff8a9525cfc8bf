"""QLoRA on CPU: the step time of LoRA on a 4-bit (NF4) base against LoRA on a full-precision
base, and their memory, in one run.

    python scripts/bench_qlora.py [--flavor debugmodel] [--seq_len 1024] [--steps 4] [--rounds 2] [--json PATH]

One process, rank 16 on every linear of the blocks, one sequence a step, in bf16 (the dtype a
4-bit base computes in on a GPU; on a CPU the bf16 products are slower than fp32 ones, alike for
both jobs) and in fp32. Each job's trainer is built once; the rounds then take ``--steps`` steps
of each job in turn (after one warm-up step each), so that a busy host slows them alike; the
median step counts. A 4-bit weight is dequantized for each product, forward and backward (and
again in a checkpointed block's recomputation): that is what the step pays for the memory.
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

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    parser = trainer_bench_parser(__doc__, seq_len=1024)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import AllocatorPeak
    from torchtitan_lite.trainer import Trainer

    jobs = {f"{base}, {dtype}": (base, dtype) for dtype in ("bfloat16", "float32") for base in ("lora", "qlora")}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for index, (name, (base, dtype)) in enumerate(jobs.items()):
            argv = ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
                    "--training.local_batch_size", "1", "--training.steps", str(10**6),
                    "--training.mixed_precision_param", dtype, "--lora.enable", "--lora.target_modules", TARGETS,
                    "--lora.quantize_base", "nf4" if base == "qlora" else "none",
                    "--validation.no-enable", "--metrics.no-enable_tensorboard", "--job.dump_folder",
                    f"{tmp}/{index}"]
            with AllocatorPeak(torch.device("cpu")) as memory:
                trainers[name] = Trainer(load_job_config(argv))
                trainers[name].train_step()  # (warm-up: the optimizer state exists after it)
                with memory.window():
                    trainers[name].train_step()
            peaks[name] = memory.peak
        times = timed_rounds(trainers, steps=args.steps, rounds=args.rounds)
    rows = []
    print(f"{args.flavor}, seq_len {args.seq_len}, one process, median of {args.steps * args.rounds} steps")
    for name, spent in times.items():
        base, dtype = jobs[name]
        median = statistics.median(spent)
        reference = statistics.median(times[f"lora, {dtype}"])
        rows.append({"job": name, "step_s": round(median, 4), "ratio": round(median / reference, 3),
                     "peak_mib": round(peaks[name] / 2**20, 2)})
        print(f"{name:18} {median:8.3f} s  {median / reference:6.3f}x  peak {peaks[name] / 2**20:8.2f} MiB")
    write_rows(args, rows)


if __name__ == "__main__":
    main()
