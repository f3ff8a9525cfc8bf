"""Pipeline schedules on CPU: the measured bubble against the theory's, and step time against FSDP.

    python scripts/bench_pipeline.py [--flavor debugmodel] [--ranks 4] [--seq_len 128]
                                     [--microbatches 4 8 16] [--steps 5] [--json PATH]

Trains the model on ``--ranks`` gloo processes (fp32, one thread each, the embedded default data)
three ways for each number of micro-batches ``m`` (one row each): pipeline ``ranks`` with 1F1B,
pipeline ``ranks`` with Interleaved1F1B (2 stages a rank), and FSDP over the ranks on the same
global batch. Each rank's time waiting on the pipeline's point-to-point transfers (the schedules'
``_wait_batch_p2p``) is its idle time; ``idle / (step - idle)`` is set against the theory's bubble
``(p - 1) / m`` (1F1B) and ``(p - 1) / (v·m)`` (interleaved, ``v`` stages a rank). The mean over
ranks and steps after two warm-up steps counts; the step time is the slowest rank's.

On a machine with fewer cores than ranks a waiting rank gives its core to a computing one, so the
step times there say little; the idle fractions still follow the schedule's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_ranks import run_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, argv: list[str], steps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed.pipelining.schedules as schedules

    torch.set_num_threads(1)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    waited = [0.0]
    wait = schedules._wait_batch_p2p

    def timed_wait(work: Any) -> Any:
        start = time.perf_counter()
        try:
            return wait(work)
        finally:
            waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait
    trainer = Trainer(load_job_config(argv))
    rows = []
    for _ in range(steps):
        waited[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        rows.append((time.perf_counter() - start, waited[0]))
    trainer.close()
    out.put((rank, rows[2:]))


def _run(argv: list[str], ranks: int, steps: int) -> dict[str, float]:
    results = run_ranks(_rank, ranks, argv, steps, timeout=1800)
    measured = steps - 2
    step_s = sum(max(rows[i][0] for _, rows in results) for i in range(measured)) / measured
    idle = [rows[i][1] / rows[i][0] for _, rows in results for i in range(measured)]
    idle_fraction = sum(idle) / len(idle)
    return {"step_s": round(step_s, 4), "idle_fraction": round(idle_fraction, 4),
            "bubble_over_compute": round(idle_fraction / (1 - idle_fraction), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    p = opts.ranks
    report: dict[str, Any] = {"flavor": opts.flavor, "ranks": p, "seq_len": opts.seq_len, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for m in opts.microbatches:
            common = ["--model.flavor", opts.flavor, "--training.seq_len", str(opts.seq_len),
                      "--training.global_batch_size", str(m), "--training.steps", str(opts.steps),
                      "--training.mixed_precision_param", "float32", "--validation.no-enable",
                      "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000"]
            pipeline = [*common, "--parallelism.pipeline_parallel_degree", str(p), "--training.local_batch_size",
                        str(m)]
            row: dict[str, Any] = {"microbatches": m, "theory_1f1b": round((p - 1) / m, 4),
                                   "theory_interleaved": round((p - 1) / (2 * m), 4)}
            row["1F1B"] = _run([*pipeline, "--job.dump_folder", f"{tmp}/a{m}"], p, opts.steps)
            row["Interleaved1F1B"] = _run([*pipeline, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                           "--job.dump_folder", f"{tmp}/b{m}"], p, opts.steps)
            row["FSDP"] = _run([*common, "--training.local_batch_size", str(max(m // p, 1)),
                                "--job.dump_folder", f"{tmp}/c{m}"], p, opts.steps)
            report["rows"].append(row)
            print(f"m={m:3d}  1F1B bubble {row['1F1B']['bubble_over_compute']:.3f} (theory {row['theory_1f1b']:.3f}),"
                  f" step {row['1F1B']['step_s']:.3f} s  |  Interleaved1F1B bubble "
                  f"{row['Interleaved1F1B']['bubble_over_compute']:.3f} (theory {row['theory_interleaved']:.3f}), "
                  f"step {row['Interleaved1F1B']['step_s']:.3f} s  |  FSDP step {row['FSDP']['step_s']:.3f} s",
                  flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
