"""Measured memory: per-rank sharded state is 1/N of the single-rank state."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_utils import run_distributed


def _measure(mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from torchtitan_lite.distributed import fsdp_mesh, init_distributed
    from torchtitan_lite.distributed.fsdp import FSDPOptions
    from torchtitan_lite.distributed.parallelize import build_sharded_model
    from torchtitan_lite.memory.measure import measure_step_memory
    from torchtitan_lite.models import get_model_spec

    device = torch.device("cpu")
    init_distributed(device)
    mesh = fsdp_mesh(device)
    spec = get_model_spec("llama3")
    args = spec.model_args("debugmodel")
    model = build_sharded_model(spec, args, mesh, device=device, seed=0,
                                fsdp=FSDPOptions(reshard_after_forward_mode=mode))
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
