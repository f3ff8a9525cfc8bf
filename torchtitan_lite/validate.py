"""Validation loss: no gradients, every rank its own windows, one reduction at the end."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.data import IGNORE_INDEX, TokenWindows, num_batches, padded_batch

__all__ = ["Validator", "token_loss_sum"]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32; labels equal to ``IGNORE_INDEX`` count nothing."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class Validator:
    """Runs the model over the validation windows in order.

    Batch ``s`` holds windows ``[s·G, (s+1)·G)`` with ``G = local_batch_size × dp_size``; rank
    ``r`` takes the ``local_batch_size`` of them from ``s·G + r·local_batch_size``. Past the end
    of the set, rows are padding whose labels count nothing, so every rank runs the same number
    of forward passes (FSDP's all-gathers need every rank) and the loss is the exact mean over the
    windows visited, whatever the world size.
    """

    def __init__(
        self,
        windows: TokenWindows,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        steps: int,
        device: torch.device,
    ) -> None:
        self.windows = windows
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        available = num_batches(len(windows), local_batch_size * dp_size)
        self.steps = available if steps == -1 else min(steps, available)

    def rank_indices(self, batch: int) -> list[int]:
        first = batch * self.local_batch_size * self.dp_size + self.dp_rank * self.local_batch_size
        return [i for i in range(first, first + self.local_batch_size) if i < len(self.windows)]

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float | None]:
        """Mean loss per token over the validation windows (same result on every rank)."""
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        try:
            for batch in range(self.steps):
                inputs, labels = padded_batch(self.windows, self.rank_indices(batch), self.local_batch_size)
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                totals[0] += token_loss_sum(model(inputs), labels).double()
                totals[1] += (labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
            _reshard(model)
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss = float(totals[0] / totals[1])
        return {
            "validation_loss": loss,
            "validation_perplexity": math.exp(loss) if loss < 700 else None,
            "validation_tokens": float(totals[1]),
            "validation_time_s": time.perf_counter() - start,
        }


def _reshard(model: nn.Module) -> None:
    """Free parameters left unsharded by forward passes without a backward (``never``/``default``
    keep some units gathered after forward; only backward would reshard them)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
