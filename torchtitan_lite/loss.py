"""The training loss: next-token cross-entropy summed in fp32 (the trainer, validation and the memory
estimator all compute it here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_lite.data import IGNORE_INDEX

__all__ = ["token_loss_sum"]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32; labels equal to ``IGNORE_INDEX`` count nothing."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
