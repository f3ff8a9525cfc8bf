"""A mixture-of-experts feed-forward any family can use: a router, experts held as stacked weights,
tokens sorted by expert and run as grouped matrix products, optional shared experts.

- :class:`TopKRouter`: softmax scores over the experts, the ``top_k`` best per token, optionally
  renormalised to sum to 1 (Qwen3-MoE's router; its scores and choices are those of
  ``transformers``' ``Qwen3MoeTopKRouter``).
- :class:`GroupedExperts`: ``num_experts`` SwiGLU experts as three stacked weights in ``nn.Linear``'s
  (out, in) layout: ``w1`` (gate) and ``w3`` (up) ``(experts, hidden, dim)``, ``w2`` (down)
  ``(experts, dim, hidden)``. The tokens routed to the experts arrive sorted by expert with each
  expert's count; ``torch._grouped_mm`` runs every expert's rows in one call where it runs
  (``use_grouped_mm``), a loop over the experts elsewhere, with the same results.
- :class:`MoE`: route, sort, run, weight each expert's output by its score and add the ``top_k``
  contributions of each token back in place; no token is dropped (no capacity limit). Shared
  experts (a dense SwiGLU every token goes through) add their output.

Each forward also leaves what balancing needs: ``tokens_per_expert`` (a buffer that accumulates
the routed token counts until read) and the router's per-token probabilities.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan_lite.models.init as init

__all__ = ["GroupedExperts", "MoE", "TopKRouter", "grouped_mm_available", "load_balancing_loss"]


@functools.cache
def grouped_mm_available(device_type: str) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type (torch >= 2.9
    on CPU; CUDA with its own alignment rules)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(8, 16, device=device_type, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device_type, requires_grad=True)
        out = torch._grouped_mm(x, w, offs=torch.tensor([3, 8], dtype=torch.int32, device=device_type))
        out.backward(torch.ones_like(out).contiguous())
        return True
    except (RuntimeError, NotImplementedError):
        return False


class TopKRouter(nn.Module):
    """Softmax router: ``(tokens, dim)`` → scores ``(tokens, top_k)``, expert indices
    ``(tokens, top_k)`` and the probabilities over every expert ``(tokens, experts)`` (fp32)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        scores, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores.to(x.dtype), indices, probs

    def init_weights(self, std: float) -> None:
        init.trunc_normal_(self.gate.weight, std=std)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards as stacked weights (see the module's docstring)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(rows, dim)``: the routed rows sorted by expert, ``counts[e]`` of them for expert
        ``e``. Returns each row through its expert, ``(rows, dim)``."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.use_grouped_mm and grouped_mm_available(x.device.type):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offs=offsets)
        out = []
        for expert, rows in enumerate(x.split(counts.tolist())):
            out.append(F.linear(F.silu(F.linear(rows, w1[expert])) * F.linear(rows, w3[expert]), w2[expert]))
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])

    def init_weights(self, out_std: float) -> None:
        init.trunc_normal_(self.w1, std=0.02)
        init.trunc_normal_(self.w2, std=out_std)
        init.trunc_normal_(self.w3, std=out_std)


class MoE(nn.Module):
    """Routed experts (and optional shared experts) in place of a dense feed-forward:
    ``(bs, seq, dim)`` → ``(bs, seq, dim)``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool = True,
                 shared_hidden_dim: int = 0, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob=norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm=use_grouped_mm)
        self.shared = None
        if shared_hidden_dim:
            from torchtitan_lite.models.decoder import FeedForward

            self.shared = FeedForward(dim, shared_hidden_dim)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        # The router's probabilities (tokens, experts) and choices of the last forward (for balancing losses).
        self.last_probs: torch.Tensor | None = None
        self.last_indices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, indices, self.last_probs = self.router(tokens)
        self.last_indices = indices
        top_k = indices.shape[1]
        flat = indices.reshape(-1)
        counts = torch.bincount(flat, minlength=self.router.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        order = torch.argsort(flat, stable=True)  # each expert's rows together, in token order
        rows = tokens[order // top_k]
        routed = self.experts(rows, counts)
        routed = routed * scores.reshape(-1, 1)[order]
        out = torch.zeros_like(tokens).index_add_(0, order // top_k, routed.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

    def init_weights(self, out_std: float) -> None:
        self.router.init_weights(std=0.02)
        self.experts.init_weights(out_std)
        if self.shared is not None:
            self.shared.init_weights(out_std)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        device = torch.device(buffer_device) if buffer_device is not None else self.tokens_per_expert.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.tokens_per_expert = torch.zeros(self.router.num_experts, dtype=torch.float32, device=device)


def load_balancing_loss(probs: list[torch.Tensor], indices: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """The load-balancing auxiliary loss as ``transformers`` computes it for Qwen3-MoE
    (``load_balancing_loss_func`` without an attention mask): over every MoE layer's tokens at
    once, ``num_experts × Σ_k Σ_e f[k, e] · P[e]`` with ``f[k, e]`` the share of tokens whose k-th
    choice is expert e and ``P[e]`` the mean router probability of e."""
    all_probs = torch.cat(probs)
    mask = F.one_hot(torch.cat(indices), num_experts).float()  # (tokens, top_k, experts)
    tokens_per_expert = mask.mean(dim=0)
    router_prob_per_expert = all_probs.mean(dim=0)
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * num_experts
