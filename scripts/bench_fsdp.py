"""Benchmark: our trainer step vs. a bare hand-written FSDP2 loop on the same model and batch.

    torchrun --standalone --nproc_per_node=2 scripts/bench_fsdp.py [--flavor debugmodel]
        [--seq_len 256] [--local_batch_size 4] [--steps 10] [--rounds 3]

Reports (rank 0) the median step time of each and their ratio, taken in the same run with the
two loops interleaved round by round, and the exact collectives per step (count and bytes per
rank) for every reshard mode, which do not depend on machine noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_lite.config import load_job_config
from torchtitan_lite.models.llama3 import ModelArgs, Transformer
from torchtitan_lite.train import Trainer, clip_grad_norm_


def _kind(op_name: str) -> str | None:
    if "allgather" in op_name or "all_gather" in op_name:
        return "all_gather"
    if "reduce_scatter" in op_name:
        return "reduce_scatter"
    if "allreduce" in op_name or "all_reduce" in op_name:
        return "all_reduce"
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives and the bytes each rank contributes (input tensors).

    ProcessGroup collectives go through the dispatcher as ``c10d::*`` ops; on CPU autograd
    runs backward in the calling thread, so backward collectives are seen too. Collectives that
    DTensor issues inside its own dispatch (the gradient-norm reduction) run below this mode and
    are not counted: the all_reduce column is the loss reduction.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = _kind(func._schema.name.split("::")[-1]) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None:
            self.calls[kind] += 1
            # all-gather / reduce-scatter: (output, input, ...); all-reduce: (tensors, ...)
            source = args[0] if kind == "all_reduce" else args[1]
            tensors = [t for t in torch.utils._pytree.tree_leaves(source)
                       if isinstance(t, torch.Tensor)]
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def _bare_model(args: ModelArgs, mesh: Any, device: torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--local_batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    torch.set_num_threads(1)

    common = [
        "--model.flavor", opts.flavor, "--training.seq_len", str(opts.seq_len),
        "--training.local_batch_size", str(opts.local_batch_size),
        "--training.steps", str(10**6), "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", str(10**6), "--job.dump_folder", "/tmp/torchtitan_lite_bench",
    ]
    trainer = Trainer(load_job_config(common))
    rank = dist.get_rank()
    bare = _bare_model(trainer.model_args, trainer.mesh, trainer.device)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=8e-4, weight_decay=0.1, foreach=True)

    def bare_step() -> None:
        micro = trainer.loader.next_batch()  # same data path cost as ours
        for inputs, labels in micro:
            inputs, labels = inputs.to(trainer.device), labels.to(trainer.device)
            loss = F.cross_entropy(bare(inputs).flatten(0, 1).float(), labels.flatten())
            loss.backward()
        clip_grad_norm_(list(bare.parameters()), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    def timed(fn: Any) -> float:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(opts.steps):
            fn()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - start) / opts.steps

    trainer.train_step()
    bare_step()  # warm-up both
    ours_t, bare_t = [], []
    for _ in range(opts.rounds):
        ours_t.append(timed(trainer.train_step))
        bare_t.append(timed(bare_step))
    ours_med, bare_med = statistics.median(ours_t), statistics.median(bare_t)

    counts: dict[str, tuple[Counter[str], Counter[str]]] = {}
    for mode in ["default", "always", "never"]:
        t = Trainer(load_job_config([*common, "--parallelism.reshard_after_forward_mode", mode]))
        t.train_step()
        with CollectiveCounter() as counter:
            t.train_step()
        counts[mode] = (counter.calls, counter.bytes)

    if rank == 0:
        tokens = opts.local_batch_size * opts.seq_len
        print(f"\nmodel {opts.flavor}, {dist.get_world_size()} ranks, {tokens} tokens/rank/step, "
              f"{opts.rounds} rounds × {opts.steps} steps, interleaved")
        print(f"  torchtitan_lite step: {ours_med * 1e3:8.1f} ms  ({tokens / ours_med:,.0f} tok/s/rank)")
        print(f"  bare FSDP2 loop step: {bare_med * 1e3:8.1f} ms  ({tokens / bare_med:,.0f} tok/s/rank)")
        print(f"  ratio ours / bare:    {ours_med / bare_med:8.3f}")
        print("\ncollectives per training step (this rank):")
        print(f"  {'mode':8s} {'all_gather':>11s} {'AG MiB':>8s} {'reduce_scatter':>15s} "
              f"{'RS MiB':>8s} {'all_reduce':>11s}")
        for mode, (calls, nbytes) in counts.items():
            print(f"  {mode:8s} {calls['all_gather']:11d} {nbytes['all_gather'] / 2**20:8.2f} "
                  f"{calls['reduce_scatter']:15d} {nbytes['reduce_scatter'] / 2**20:8.2f} "
                  f"{calls['all_reduce']:11d}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
