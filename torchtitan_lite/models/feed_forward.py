"""The SwiGLU feed-forward of our decoders' dense layers and of a mixture of experts' shared
experts: ``w2(silu(w1 x) * w3 x)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan_lite.models.init as init

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        init.trunc_normal_(self.w1.weight, std=0.02)
        init.trunc_normal_(self.w2.weight, std=out_std)
        init.trunc_normal_(self.w3.weight, std=out_std)
