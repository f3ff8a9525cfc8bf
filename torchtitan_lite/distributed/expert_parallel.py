"""Expert parallelism: a mixture of experts' experts split over ranks, tokens moved to them.

With ``ep`` expert-parallel ranks, rank ``r`` of the group holds experts ``[r·E/ep, (r+1)·E/ep)`` of
each MoE layer. An MoE layer routes its own tokens as before; :class:`AllToAllDispatcher` then
sends each routed row to the rank that holds its expert and brings the experts' outputs back:

1. every rank tells every other how many rows it sends to each of that rank's experts (one
   ``all_to_all_single`` of ``E`` counts);
2. the rows go out with per-rank split sizes (``all_to_all_single``, differentiable: its backward
   is the reverse exchange), arriving grouped by source rank, each source's rows sorted by expert;
3. they are regrouped by local expert (the order the grouped products need), run, put back in
   arrival order and
4. returned by the reverse exchange.

No row is dropped and nothing is padded: the split sizes are the routed counts. gloo runs
``all_to_all_single`` on CPU, NCCL on GPUs.

The MoE layer calls the dispatcher it is given (``MoE.dispatcher``); model code holds no process
group. :func:`shard_experts` gives every MoE layer of a model built on the meta device one, over
the mesh's ``ep`` group, and splits its experts' weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

__all__ = ["AllToAllDispatcher", "expert_parallel_problem", "local_experts", "shard_experts"]


def expert_parallel_problem(num_experts: int, ep: int) -> str | None:
    """Why ``num_experts`` experts cannot split over ``ep`` ranks, or None: the one place of the rule."""
    return f"it must divide the {num_experts} experts" if num_experts % ep else None


def local_experts(num_experts: int, ep: int, rank: int) -> range:
    """The experts rank ``rank`` of ``ep`` expert-parallel ranks holds (``ValueError`` when ``ep``
    does not divide the experts)."""
    problem = expert_parallel_problem(num_experts, ep)
    if problem is not None:
        raise ValueError(f"expert parallel degree {ep}: {problem}")
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


class AllToAllDispatcher:
    """Moves an MoE layer's routed rows to the ranks of ``group`` that hold their experts and the
    experts' outputs back (see the module's docstring). ``all_to_all_calls`` counts the exchanges
    (for tests and metrics)."""

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.local = local_experts(num_experts, self.ep, self.rank)
        self.all_to_all_calls = 0

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``rows`` sorted by expert with ``counts[e]`` rows for expert ``e`` (every expert of the
        layer) → the rows this rank's experts run, sorted by local expert, their counts per
        local expert, and what :meth:`combine` needs."""
        ep, per_rank = self.ep, len(self.local)
        counts = counts.to(torch.int64)

        if is_fake(rows):
            return self._balanced(rows)
        # (source rank, local expert) counts; functional, so that selective checkpointing keeps
        # it (with the rows' exchanges) rather than exchanging again in the recompute
        received = _exchange(counts, None, None, self.group)
        send = counts.view(ep, per_rank).sum(dim=1).tolist()
        received_by_source = received.view(ep, per_rank)
        recv = received_by_source.sum(dim=1).tolist()
        arrived = _exchange(rows, recv, send, self.group)
        self._count(2)
        # Arrival order: source rank, then local expert. The experts need local expert, then source.
        order = _regroup(received_by_source.to(rows.device))
        local_rows = arrived.index_select(0, order)
        return local_rows, received_by_source.sum(dim=0), (order, send, recv, rows.shape[0])

    def _balanced(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The memory estimator's exchange (fake tensors, a fake process group, no counts to
        read): every rank sends each other rank an equal share of its rows and receives as many,
        spread evenly over its experts (routing balanced, which balancing losses aim at)."""
        ep, per_rank = self.ep, len(self.local)
        share = [rows.shape[0] // ep + (1 if r < rows.shape[0] % ep else 0) for r in range(ep)]
        arrived = _exchange(rows, share, share, self.group)
        order = torch.arange(rows.shape[0], device=rows.device)
        local_rows = arrived.index_select(0, order)
        even = rows.shape[0] // per_rank
        local_counts = torch.full((per_rank,), even, dtype=torch.int64, device=rows.device)
        local_counts[-1] += rows.shape[0] - even * per_rank
        return local_rows, local_counts, (order, share, share, rows.shape[0])

    def combine(self, out: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs (in :meth:`dispatch`'s local order) back to the ranks whose rows
        they were, in those ranks' sorted order."""
        order, send, recv, rows = state
        arrival = torch.empty_like(out).index_copy(0, order, out)  # back to arrival order
        result = _exchange(arrival, send, recv, self.group)
        self._count(1)
        return result

    def _count(self, calls: int) -> None:
        """Count exchanges run by a forward, not those a checkpointed block's recompute replays."""
        if torch._C._current_graph_task_id() == -1:
            self.all_to_all_calls += calls


def _exchange(rows: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
              group: Any) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` with split sizes (None: equal), differentiable (its
    backward: the reverse exchange)."""

    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))


def _regroup(sizes: torch.Tensor) -> torch.Tensor:
    """Row order that takes rows arriving in blocks ``sizes[s, e]`` (source ``s`` major) to
    local expert major: for each expert, its rows from every source in source order."""
    starts = (torch.cumsum(sizes.flatten(), 0) - sizes.flatten()).view_as(sizes)  # each block's first row
    sizes_t, starts_t = sizes.t().flatten(), starts.t().flatten()  # blocks in (expert, source) order
    total = int(sizes.sum())
    block = torch.repeat_interleave(torch.arange(sizes_t.numel(), device=sizes.device), sizes_t, output_size=total)
    first = torch.cumsum(sizes_t, 0) - sizes_t  # each block's first position in the new order
    return starts_t[block] + torch.arange(total, device=sizes.device) - first[block]


def _split_experts(model: nn.Module, group: Any,
                   local_weight: Callable[[torch.Tensor, range], torch.Tensor]) -> list[Any]:
    """Give every MoE layer of ``model`` an :class:`AllToAllDispatcher` over ``group`` and replace
    each stacked expert weight (and its LoRA adapters, stacked the same way) by
    ``local_weight(weight, this rank's experts)``; the layers."""
    from torchtitan_lite.models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        experts = layer.experts
        layer.dispatcher = AllToAllDispatcher(group, experts.num_experts)
        for name in experts.stacked_weights:
            adapters = getattr(experts, f"lora_{name}", None)  # LoRA's stacked adapters split with their weight
            for owner, attr in ((experts, name), *(((adapters, "lora_A"), (adapters, "lora_B")) if adapters else ())):
                weight = getattr(owner, attr)
                setattr(owner, attr, nn.Parameter(local_weight(weight, layer.dispatcher.local),
                                                  requires_grad=weight.requires_grad))
    return layers


def shard_experts(model: nn.Module, mesh: Any) -> list[nn.Module]:
    """Expert parallel over ``mesh["ep"]`` (a :class:`~torchtitan_lite.distributed.mesh.ParallelMesh`
    with an ``ep`` dimension), on a model built on the meta device: each MoE layer's stacked
    expert weights become DTensors split along the experts over ``mesh["ep"]`` (each rank will
    hold only its experts) and the layer gets an :class:`AllToAllDispatcher` over that group.
    Returns each layer's experts module: :func:`~torchtitan_lite.distributed.fsdp.apply_fsdp`
    shards them over the expert-data ranks (``mesh.experts``, its ``experts`` argument)."""
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh["ep"]

    def split(weight: torch.Tensor, local: range) -> torch.Tensor:
        shard = torch.empty((len(local), *weight.shape[1:]), device=weight.device, dtype=weight.dtype)
        return DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False, shape=weight.shape,
                                  stride=weight.stride())

    return [layer.experts for layer in _split_experts(model, ep_mesh.get_group(), split)]
