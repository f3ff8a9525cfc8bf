"""Pipeline schedules on CPU: the measured bubble against the theory's, and step time against FSDP.

    python scripts/bench_pipeline.py [--flavor debugmodel] [--ranks 4] [--seq_len 128]
                                     [--microbatches 4 8 16] [--steps 5] [--json PATH]
                                     [--emulate_block_ms MS]

Trains the model on ``--ranks`` gloo processes (fp32, one thread each, the embedded default data)
several ways for each number of micro-batches ``m`` (one row each): pipeline ``ranks`` with 1F1B,
pipeline ``ranks`` with Interleaved1F1B (2 stages a rank), and FSDP over the ranks on the same
global batch. A rank's compute is its time in the schedule's ``step`` less what it spent waiting
on the point-to-point transfers (the schedules' ``_wait_batch_p2p``); its idle time is the rest of
the pipeline's run, which ends for every pipeline rank at the loss's all-reduce after the last
backward (not the step's optimizer, clipping and metrics). ``idle / compute`` is set against the
theory's bubble
``(p - 1) / m`` (1F1B) and ``(p - 1) / (v·m)`` (interleaved, ``v`` stages a rank). The mean over
ranks and steps after two warm-up steps counts; the step time is the slowest rank's.

On a machine with fewer cores than ranks a waiting rank gives its core to a computing one, so the
step times there say little and the idle fractions drift towards one half. ``--emulate_block_ms
MS`` measures the schedules there all the same: each block's compute becomes a wait of ``MS``
per row in forward, ``MS`` per row in its backward's input pass and ``MS`` per row in its weight
pass (the zero-bubble paper's equal times; 1F1B's backward is both), which takes no core. The model then has 8 blocks
and no layer shares for the embedding and output (4 and 8 stages of equal blocks), and the two
zero-bubble schedules join the rows. The schedules, their transfers, FSDP and the optimizer run
for real; only the blocks' arithmetic is replaced.
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


def _emulate_blocks(block_s: float) -> None:
    """Every decoder block's compute becomes waits (see the module's doc), each ``block_s`` per
    row: forward; backward on the input's path, and on a separate path to the block's first norm
    weight, so that a split backward runs one in each pass. Adds the ``bench8`` flavor
    (debugmodel with 8 blocks)."""
    import dataclasses

    import torch

    from torchtitan_lite.models import decoder
    from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS

    LLAMA3_FLAVORS["bench8"] = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=8)

    class InputPath(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            time.sleep(block_s * x.shape[0])  # (a block's time grows with its rows)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(block_s * grad.shape[0])
            return grad

    class WeightPath(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            ctx.weight_shape = weight.shape
            return torch.zeros_like(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
            time.sleep(block_s * grad.shape[0])
            return None, grad.new_zeros(ctx.weight_shape)

    def forward(self: Any, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        return InputPath.apply(x) + WeightPath.apply(x.detach(), self.attention_norm.weight)

    decoder.TransformerBlock.forward = forward


def _timed(function: Any, total: list[float]) -> Any:
    """``function``, adding its wall time to ``total[0]`` on each call."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return timed


def _rank(rank: int, world: int, port: int, argv: list[str], steps: int, block_s: float | None, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed.pipelining.schedules as schedules

    torch.set_num_threads(1)
    if block_s is not None:
        _emulate_blocks(block_s)
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    waited, scheduled, stepped = [0.0], [0.0], [0.0]
    schedules._wait_batch_p2p = _timed(schedules._wait_batch_p2p, waited)
    # The schedule's own time: its runs in the step (the step's optimizer, clipping and metrics
    # are not the schedule's), and inside them the rank's compute and its waits
    from torchtitan_lite.distributed.pipeline_parallel import PipelineRunner

    PipelineRunner.forward_backward = _timed(PipelineRunner.forward_backward, scheduled)
    trainer = Trainer(load_job_config(argv))
    if trainer.runner.pipeline is not None:
        trainer.runner.pipeline.schedule.step = _timed(trainer.runner.pipeline.schedule.step, stepped)
    rows = []
    for _ in range(steps):
        waited[0] = scheduled[0] = stepped[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        rows.append((time.perf_counter() - start, scheduled[0], stepped[0] - waited[0]))
    trainer.close()
    out.put((rank, rows[2:]))


def _run(argv: list[str], ranks: int, steps: int, block_s: float | None = None) -> dict[str, float]:
    results = run_ranks(_rank, ranks, argv, steps, block_s, timeout=1800)
    measured = steps - 2
    step_s = sum(max(rows[i][0] for _, rows in results) for i in range(measured)) / measured
    schedule_s = sum(max(rows[i][1] for _, rows in results) for i in range(measured)) / measured
    # Each rank's idle share of the pipeline's run, from its first stage's start to the loss's
    # all-reduce, which every pipeline rank reaches after the last backward (so the ranks that
    # end early count their wait as the theory's cooldown does): 1 - compute / run (FSDP: none)
    idle = [1 - rows[i][2] / rows[i][1] if rows[i][1] else 0.0 for _, rows in results for i in range(measured)]
    idle_fraction = sum(idle) / len(idle)
    return {"step_s": round(step_s, 4), "schedule_s": round(schedule_s, 4), "idle_fraction": round(idle_fraction, 4),
            "bubble_over_compute": round(idle_fraction / (1 - idle_fraction), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--emulate_block_ms", type=float, default=None,
                        help="replace each block's compute by waits of this many ms (see the doc)")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    p = opts.ranks
    block_s = None if opts.emulate_block_ms is None else opts.emulate_block_ms / 1e3
    flavor = "bench8" if block_s is not None else opts.flavor
    schedules = ["1F1B", "Interleaved1F1B"]
    even: list[str] = []
    if block_s is not None:
        schedules += ["InterleavedZeroBubble", "ZBVZeroBubble"]
        even = ["--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                "--parallelism.pipeline_parallel_last_stage_less_layers", "0"]
    report: dict[str, Any] = {"flavor": flavor, "ranks": p, "seq_len": opts.seq_len,
                              "emulate_block_ms": opts.emulate_block_ms, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for m in opts.microbatches:
            common = ["--model.flavor", flavor, "--training.seq_len", str(opts.seq_len),
                      "--training.global_batch_size", str(m), "--training.steps", str(opts.steps),
                      "--training.mixed_precision_param", "float32", "--validation.no-enable",
                      "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000"]
            pipeline = [*common, *even, "--parallelism.pipeline_parallel_degree", str(p),
                        "--training.local_batch_size", str(m)]
            row: dict[str, Any] = {"microbatches": m, "theory_1f1b": round((p - 1) / m, 4),
                                   "theory_interleaved": round((p - 1) / (2 * m), 4)}
            for index, schedule in enumerate(schedules):
                row[schedule] = _run([*pipeline, "--parallelism.pipeline_parallel_schedule", schedule,
                                      "--job.dump_folder", f"{tmp}/{index}-{m}"], p, opts.steps, block_s)
            row["FSDP"] = _run([*common, "--training.local_batch_size", str(max(m // p, 1)),
                                "--job.dump_folder", f"{tmp}/fsdp-{m}"], p, opts.steps, block_s)
            report["rows"].append(row)
            print(f"m={m:3d}  " + "  |  ".join(
                f"{name} bubble {row[name]['bubble_over_compute']:.3f}, step {row[name]['step_s']:.3f} s "
                f"(schedule {row[name]['schedule_s']:.3f} s)"
                for name in schedules) + f"  |  FSDP step {row['FSDP']['step_s']:.3f} s  (theory 1F1B "
                  f"{row['theory_1f1b']:.3f}, interleaved {row['theory_interleaved']:.3f})", flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
