"""A mixture of experts' experts: ``num_experts`` SwiGLU feed-forwards as three stacked weights in
``nn.Linear``'s (out, in) layout: ``w1`` (gate) and ``w3`` (up) ``(experts, hidden, dim)``, ``w2``
(down) ``(experts, dim, hidden)``. The routed rows arrive sorted by expert with each expert's
count; :func:`~torchtitan_lite.models.moe.grouped_mm.grouped_mm` runs every expert's rows in one
call where it runs (``use_grouped_mm``), a loop over the experts elsewhere, with the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import torchtitan_lite.models.init as init
from torchtitan_lite.models.moe.grouped_mm import grouped_mm

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards as stacked weights (see the module's docstring)."""

    stacked_weights = ("w1", "w2", "w3")
    """The stacked ``(experts, out, in)`` weights (what LoRA on experts adapts)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(rows, dim)``: the routed rows sorted by expert, ``counts[e]`` of them for expert
        ``e``. Returns each row through its expert, ``(rows, dim)``: grouped products
        (:func:`grouped_mm`), or with ``use_grouped_mm`` off a loop over the experts (eagerly;
        compiled, the grouped operator)."""
        w1, w2, w3 = self.expert_weights()
        if self.use_grouped_mm or torch.compiler.is_compiling():
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            gate = grouped_mm(x, w1.transpose(-2, -1), offsets)
            up = grouped_mm(x, w3.transpose(-2, -1), offsets)
            return grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offsets)
        out = []
        for expert, rows in enumerate(x.split(counts.tolist())):
            out.append(F.linear(F.silu(F.linear(rows, w1[expert])) * F.linear(rows, w3[expert]), w2[expert]))
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights the experts compute with: ``w1``, ``w2``, ``w3`` (LoRA adds its updates);
        split over expert-parallel ranks (DTensors), this rank's experts."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))

    def init_weights(self, out_std: float) -> None:
        init.trunc_normal_(self.w1, std=0.02)
        init.trunc_normal_(self.w2, std=out_std)
        init.trunc_normal_(self.w3, std=out_std)
