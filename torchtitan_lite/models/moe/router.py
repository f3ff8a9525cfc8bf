"""The router of a mixture of experts: scores over the experts and the ``top_k`` best per token.

``score_func = "softmax"`` is Qwen3-MoE's router (its scores and choices are those of
``transformers``' ``Qwen3MoeTopKRouter``; optional renormalisation of the chosen scores).
``"sigmoid"`` is DeepSeek-V3's: sigmoid scores, a per-expert bias (``expert_bias``, Hugging Face's
``e_score_correction_bias``) added for the choice only, the choice limited to the ``topk_group``
best of ``n_group`` expert groups (a group's score: the sum of its two best), the chosen scores
renormalised and multiplied by ``route_scale``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan_lite.models.init as init

__all__ = ["SCORE_FUNCS", "Routing", "TopKRouter", "expert_counts", "router_problem"]

SCORE_FUNCS = ("softmax", "sigmoid")
"""The router kinds (``score_func``)."""


class Routing(NamedTuple):
    """One forward's routing: ``logits`` and ``probs`` ``(tokens, experts)`` in fp32 (``probs``:
    the softmax, or the sigmoid scores normalised per token; what the load-balancing loss
    averages) and the chosen experts ``indices`` ``(tokens, top_k)``."""

    logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor


def router_problem(num_experts: int, top_k: int, score_func: str, n_group: int, topk_group: int) -> str | None:
    """What is wrong with a router's settings, as a phrase naming the setting, or None."""
    if score_func not in SCORE_FUNCS:
        return f"score_func {score_func!r} is not one of {', '.join(map(repr, SCORE_FUNCS))}"
    if not 1 <= top_k <= num_experts:
        return f"top_k {top_k} must be between 1 and the number of experts {num_experts}"
    if n_group < 1 or num_experts % n_group:
        return f"n_group {n_group} must divide the number of experts {num_experts}"
    if n_group > 1 and num_experts // n_group < 2:
        return f"n_group {n_group} leaves fewer than 2 experts per group (a group's score sums its best two)"
    if not 1 <= topk_group <= n_group:
        return f"topk_group {topk_group} must be between 1 and n_group {n_group}"
    if topk_group * (num_experts // n_group) < top_k:
        return f"top_k {top_k} is more than the {topk_group} chosen group(s) of {num_experts // n_group} experts hold"
    return None


class TopKRouter(nn.Module):
    """``(tokens, dim)`` → the chosen experts' gates ``(tokens, top_k)`` (what each chosen
    expert's output is multiplied by, in ``x``'s dtype) and
    the :class:`Routing` (see the module's docstring for the two kinds)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0, n_group: int = 1,
                 topk_group: int = 1) -> None:
        super().__init__()
        problem = router_problem(num_experts, top_k, score_func, n_group, topk_group)
        if problem is not None:
            raise ValueError(problem)
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk_prob, self.route_scale = norm_topk_prob, route_scale
        self.n_group, self.topk_group = n_group, topk_group
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # The sigmoid router's balancing bias (used for the choice only; updated by
        # update_expert_bias, saved with the model).
        self.expert_bias: torch.Tensor | None
        if score_func == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        logits = F.linear(x.float(), self.gate.weight.float())  # in fp32, as transformers' routers
        if self.score_func == "softmax":
            scores = probs = F.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        # (The bias may live on CPU under CPU offload: it is a few numbers.)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.device)
        if self.n_group > 1:
            grouped = choice.detach().view(-1, self.n_group, self.num_experts // self.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1),
                                        float("-inf"))
        indices = torch.topk(choice.detach(), self.top_k, dim=-1).indices
        gates = scores.gather(1, indices)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            gates = gates * self.route_scale
        return gates.to(x.dtype), Routing(logits, probs, indices)

    def init_weights(self, std: float) -> None:
        init.trunc_normal_(self.gate.weight, std=std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def expert_counts(routing: Routing | torch.Tensor, num_experts: int, *,
                  dtype: torch.dtype = torch.float32, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert in one forward (its ``Routing``, or the routed indices),
    ``(experts,)`` (by ``scatter_add``: a static shape, unlike ``bincount``'s, for torch.compile).
    ``weights``: what each choice counts (one per index, flattened; None: 1)."""
    flat = (routing if isinstance(routing, torch.Tensor) else routing.indices).reshape(-1)
    ones = torch.ones_like(flat, dtype=dtype) if weights is None else weights.reshape(-1).to(dtype)
    return torch.zeros(num_experts, dtype=dtype, device=flat.device).scatter_add_(0, flat, ones)
