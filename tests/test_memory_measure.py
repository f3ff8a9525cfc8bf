"""Measured memory: per-rank sharded state is 1/N of the single-rank state."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_utils import run_distributed


def _measure(mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.models import get_model_spec

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    spec = get_model_spec("llama3")
    args = spec.model_args("debugmodel")
    model = build_sharded_model(spec, args, mesh, device=device, seed=0,
                                reshard_after_forward_mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    result = measure_step_memory(model, optimizer, loss)
    result["param_bytes"] = args.num_params() * 4
    dist.barrier()
    return result


@pytest.mark.slow
def test_sharded_state_per_rank_is_one_nth_of_one_rank():
    """Sharded params, grads and optimizer state measured on every rank at world size 2 and 4
    are within 5% of 1/N of what one rank holds alone (FSDP pads uneven shards)."""
    (one,) = run_distributed(_measure, 1, "default")
    full = one["param_bytes"]
    assert abs(one["state"]["sharded_params"] - full) <= 0.01 * full
    assert abs(one["state"]["sharded_grads"] - full) <= 0.01 * full
    assert abs(one["state"]["optimizer_state"] - 2 * full) <= 0.01 * 2 * full  # AdamW: 2 moments
    for world in (2, 4):
        for rank, result in enumerate(run_distributed(_measure, world, "default")):
            for key in ("sharded_params", "sharded_grads", "optimizer_state"):
                expected = one["state"][key] / world
                got = result["state"][key]
                assert abs(got - expected) <= 0.05 * expected, (world, rank, key, got, expected)
            # The peak holds more than the state: activations and gathered parameters.
            assert result["peak"]["total"] > result["state"]["sharded_params"] + result["peak"]["activations"]


def test_allocator_peak_counts_live_tensors_from_the_allocators_events() -> None:
    """``AllocatorPeak`` (the CPU allocator's own running total, reported to torch.profiler; not a
    tracker of ours): a tensor made before the window counts while alive, a freed one stops
    counting; the peak is the largest sum within the window."""
    import torch

    from torchtitan_lite.memory.measure import AllocatorPeak

    mb = 500 * 500 * 4
    with AllocatorPeak(torch.device("cpu")) as memory:
        x = torch.randn(500, 500)  # 1 MB, made before the window
        with memory.window():
            y = x @ x  # 2 MB live
            z = y * 2  # 3 MB live (the peak)
            del y  # 2 MB
            w = z + 1  # 3 MB again
            del z, w
    assert 3 * mb <= memory.peak <= 3 * mb + 4096, memory.peak


def test_allocator_peak_of_a_trainer_step_holds_its_state(tmp_path: Any) -> None:
    """The peak of one real ``Trainer.train_step`` on one process is at least the parameters,
    their gradients and AdamW's two moments (fp32: 16 bytes a parameter), and below a loose
    ceiling (four times that, plus 16 MiB of activations): a sanity check of the instrument; how
    the estimator compares with it is scripts/benchmark.py --parts peak."""
    import torch

    from tests.conftest import TINY_ARGS
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.memory.measure import AllocatorPeak
    from torchtitan_lite.trainer import Trainer

    with AllocatorPeak(torch.device("cpu")) as memory:
        trainer = Trainer(load_job_config([*TINY_ARGS, "--job.dump_folder", str(tmp_path), "--training.steps", "3"]))
        try:
            trainer.train_step()  # the optimizer state exists from here on
            with memory.window():
                trainer.train_step()
            params = sum(p.numel() for p in trainer.model.parameters())
        finally:
            trainer.close()
    assert 16 * params <= memory.peak <= 64 * params + 2**24, (memory.peak, params)


def test_allocator_peak_counts_each_session_from_its_start() -> None:
    """Two measurements in one process: the second does not include what the first allocated."""
    import torch

    from torchtitan_lite.memory.measure import profiled_peak

    kept = []
    first = profiled_peak(lambda: kept.append(torch.zeros(250_000)), device=torch.device("cpu"))
    second = profiled_peak(lambda: kept.append(torch.zeros(250_000)), device=torch.device("cpu"))
    assert first == second == 1_000_000, (first, second)


def test_allocator_peak_sees_frees_on_other_threads_and_of_earlier_sessions() -> None:
    """Gloo's worker threads free the buffers of the collectives they ran, outside the threads the
    profiler follows; and a tensor of an earlier measurement may be freed during a later one.
    Both drop the count at once: the peak is what was really alive, not a figure that keeps
    the thread's tensor (2 MB) or falls below zero."""
    import threading

    import torch

    from torchtitan_lite.memory.measure import AllocatorPeak

    mb = 250_000  # floats: 1 MB
    with AllocatorPeak(torch.device("cpu")) as first:
        earlier = torch.zeros(4 * mb)
        with first.window():
            pass
    with AllocatorPeak(torch.device("cpu")) as memory:
        held = [torch.zeros(mb)]
        with memory.window():
            del earlier  # 4 MB of the first session freed here
            thread = threading.Thread(target=held.clear)  # 1 MB freed on another thread
            thread.start()
            thread.join()
            b = torch.zeros(mb)  # 1 MB live: the peak
            c = torch.zeros(mb // 2)  # 1.5 MB
            del b, c
    assert 1_500_000 <= memory.peak <= 1_500_000 + 4096, memory.peak
