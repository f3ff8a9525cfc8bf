"""The mixture-of-experts layer: route, sort, dispatch, run, weight, add back.

:class:`MoE` is built from its parts (a router, the experts, optional shared experts: a dense
SwiGLU every token goes through); :meth:`MoE.from_args` builds them from a family's args. Each
forward routes every token, sorts the routed rows by expert, hands them to the layer's
dispatcher (:class:`LocalDispatcher`: every expert is here; expert parallel puts in one that moves
the rows to the ranks holding their experts and back,
:class:`torchtitan_lite.distributed.expert_parallel.AllToAllDispatcher`), runs the experts,
weights each expert's output by its score and adds the ``top_k`` contributions of each token back
in place; no token is dropped (no capacity limit).

Each forward leaves its :class:`~torchtitan_lite.models.moe.router.Routing` (router logits,
probabilities, choices) on the module as ``last_routing``: what the balancing losses and load
metrics (:mod:`torchtitan_lite.models.moe.balance`) read after the forward. Nothing is counted
inside the forward, so a forward recomputed by activation checkpointing changes nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from torchtitan_lite.models.feed_forward import FeedForward
from torchtitan_lite.models.moe.experts import GroupedExperts
from torchtitan_lite.models.moe.router import Routing, TopKRouter, expert_counts

__all__ = ["Dispatcher", "LocalDispatcher", "MoE", "moe_layers"]


class Dispatcher(Protocol):
    """Where an MoE layer's routed rows run: :meth:`dispatch` gives the rows this rank's experts
    run and their counts per local expert, :meth:`combine` brings the experts' outputs back in
    the order the rows were given."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, out: torch.Tensor, state: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert is on this rank: the rows run where they are."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return rows, counts, None

    def combine(self, out: torch.Tensor, state: Any) -> torch.Tensor:
        return out


class MoE(nn.Module):
    """Routed experts (and optional shared experts) in place of a dense feed-forward:
    ``(bs, seq, dim)`` → ``(bs, seq, dim)``."""

    def __init__(self, *, router: TopKRouter, experts: GroupedExperts, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        if router.num_experts != experts.num_experts:
            raise ValueError(f"the router chooses among {router.num_experts} experts, the layer has "
                             f"{experts.num_experts}")
        self.router, self.experts, self.shared = router, experts, shared_experts
        self.last_routing: Routing | None = None
        self.dispatcher: Dispatcher = LocalDispatcher()

    @classmethod
    def from_args(cls, args: object) -> MoE:
        """The MoE layer of a family's args: ``dim``, ``moe_hidden_dim``, ``num_experts``,
        ``top_k``, ``score_func``, ``norm_topk_prob``, ``route_scale``, ``n_group``,
        ``topk_group`` and ``shared_hidden_dim``."""
        a: Any = args
        return cls.build(a.dim, a.moe_hidden_dim, a.num_experts, a.top_k, score_func=a.score_func,
                         norm_topk_prob=a.norm_topk_prob, route_scale=a.route_scale, n_group=a.n_group,
                         topk_group=a.topk_group, shared_hidden_dim=a.shared_hidden_dim)

    @classmethod
    def build(cls, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
              norm_topk_prob: bool = True, route_scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
              shared_hidden_dim: int = 0, use_grouped_mm: bool = True) -> MoE:
        """A layer of a :class:`TopKRouter` of these settings, ``num_experts`` experts of width
        ``hidden_dim`` and, with ``shared_hidden_dim``, shared experts of that width."""
        return cls(router=TopKRouter(dim, num_experts, top_k, score_func=score_func, norm_topk_prob=norm_topk_prob,
                                     route_scale=route_scale, n_group=n_group, topk_group=topk_group),
                   experts=GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm=use_grouped_mm),
                   shared_experts=FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        gates, routing = self.router(tokens)
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            # (Not from a forward that activation checkpointing recomputes during backward: that
            # routing is read by nobody and would keep the recomputed router's graph alive.)
            self.last_routing = routing
        indices = routing.indices
        top_k = indices.shape[1]
        flat = indices.reshape(-1)
        counts = expert_counts(routing, self.router.num_experts, dtype=torch.int64)
        order = torch.argsort(flat, stable=True)  # each expert's rows together, in token order
        token_of_row = order // top_k
        # (index_select and index_add_: each other's backward, with no sorting or copies inside.)
        rows = tokens.index_select(0, token_of_row)
        local_rows, local_counts, state = self.dispatcher.dispatch(rows, counts)
        routed = self.dispatcher.combine(self.experts(local_rows, local_counts), state)
        routed = routed * gates.reshape(-1, 1).index_select(0, order)
        out = torch.zeros_like(tokens).index_add_(0, token_of_row, routed.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

    def init_weights(self, out_std: float) -> None:
        self.router.init_weights(std=0.02)
        self.experts.init_weights(out_std)
        if self.shared is not None:
            self.shared.init_weights(out_std)


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE layers by qualified name, in forward order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MoE)}
