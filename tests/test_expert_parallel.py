"""Expert parallelism's token exchange (``torchtitan_lite/distributed/expert_parallel.py``): an MoE
layer whose experts are split over 2 or 4 gloo ranks, each rank routing its own tokens, gives every
rank the outputs and input gradients of the whole layer run in one process on that rank's tokens,
and each rank's experts the gradient summed over every rank's tokens; the exchanges ran."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

DIM, HIDDEN, EXPERTS, TOP_K = 32, 24, 8, 2


def _ranks(world: int) -> dict[str, float]:
    import torch.distributed as dist

    from torchtitan_lite.distributed import init_distributed
    from torchtitan_lite.distributed.expert_parallel import apply_expert_parallel
    from torchtitan_lite.models.moe import MoE

    init_distributed(torch.device("cpu"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=16)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    parallel = MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=16)
    parallel.load_state_dict(reference.state_dict())
    (dispatcher,) = apply_expert_parallel(parallel, dist.group.WORLD)
    # Each rank's own tokens (some experts get none on some ranks: 9 tokens, top-2 of 8).
    x = torch.randn(1, 9 + 4 * rank, DIM, generator=torch.Generator().manual_seed(10 + rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + rank))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = reference(a), parallel(b)
    out_ref.backward(grad)
    out.backward(grad)
    errors = {"output": float((out - out_ref).abs().max()), "input_grad": float((b.grad - a.grad).abs().max()),
              "router_grad": float((parallel.router.gate.weight.grad - reference.router.gate.weight.grad).abs().max())}
    rows = slice(dispatcher.local.start, dispatcher.local.stop)
    for name in ("w1", "w2", "w3"):
        full = getattr(reference.experts, name).grad.clone()
        dist.all_reduce(full)  # an expert's gradient: over every rank's tokens
        errors[name] = float((getattr(parallel.experts, name).grad - full[rows]).abs().max())
        assert getattr(parallel.experts, name).shape[0] == EXPERTS // dist.get_world_size()
    errors["calls"] = dispatcher.all_to_all_calls
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("world", [4])
def test_experts_split_over_ranks_equal_the_whole_layer(world: int) -> None:
    for errors in run_distributed(_ranks, world, world):
        assert errors.pop("calls") == 3  # counts, rows out, outputs back (backward: the reverse exchanges)
        assert all(v <= 1e-5 for v in errors.values()), errors
