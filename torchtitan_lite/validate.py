"""Validation loss: no gradients, every rank its own windows, one reduction at the end (of
preference pairs: DPO's loss and reward metrics)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.data import PairWindows, pair_batch
from torchtitan_lite.data.windows import (
    IGNORE_INDEX,
    Documents,
    PackedWindows,
    TokenWindows,
    num_batches,
    padded_batch,
)
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.dpo import METRICS, PreferenceStep
from torchtitan_lite.loss import token_loss_sum

__all__ = ["Validator"]


class Validator:
    """Runs the model over the first ``num_windows`` validation windows, in order.

    ``num_windows`` is ``steps × global_batch_size`` (or the whole set for ``steps = -1``),
    capped at the set's size: it does not depend on the world size when ``global_batch_size``
    does not. Forward pass ``p`` of rank ``r`` reads windows from ``(p·dp_size + r) ·
    local_batch_size``; rows past ``num_windows`` are padding whose labels count nothing, so
    every rank runs the same number of forward passes (FSDP's all-gathers need every rank) and
    the loss is the exact mean over those windows.

    Preference pairs (:class:`~torchtitan_lite.data.preference.PairWindows`, a window per pair)
    need :attr:`preference`, the job's DPO step: the loss is then the mean pair loss, with the
    means of :data:`~torchtitan_lite.dpo.METRICS` as ``validation/dpo/…``.
    """

    def __init__(
        self,
        windows: TokenWindows | PackedWindows | PairWindows,
        *,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        steps: int,
        device: torch.device,
        documents: Documents | None = None,
    ) -> None:
        self.windows = windows
        self.documents = documents  # block-causal attention over plain windows: the tokenizer's BOS/EOS
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.group: Any = None  # the group its sums are reduced over (None: the default): data × context parallel
        self.context_parallel: Any = None  # with context parallel: each rank's share of every sequence
        self.preference: PreferenceStep | None = None  # DPO: how pairs are scored (and their reference)
        self.pipeline: Any = None  # pipeline parallel: the forward-only schedule over the stages
        self.device = device
        wanted = len(windows) if steps == -1 else steps * global_batch_size
        self.num_windows = min(len(windows), wanted)
        self.passes = num_batches(self.num_windows, local_batch_size * dp_size)

    def rank_indices(self, forward_pass: int) -> list[int]:
        """Window indices this rank reads in ``forward_pass`` (fewer than a batch at the end)."""
        first = (forward_pass * self.dp_size + self.dp_rank) * self.local_batch_size
        return list(range(first, min(first + self.local_batch_size, self.num_windows)))

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float | None]:
        """Mean loss per token (per pair) over the validation windows (same result on every rank)."""
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        pairs = isinstance(self.windows, PairWindows)
        if pairs and self.preference is None:
            raise ValueError("Validator: preference pairs are scored by a DPO step: set Validator.preference")
        totals = torch.zeros(1 + len(METRICS) if pairs else 2, dtype=torch.float64, device=self.device)
        try:
            for forward_pass in range(self.passes):
                indices = self.rank_indices(forward_pass)
                if pairs:  # padding pairs: every label ignored, left out of the sums
                    assert self.preference is not None
                    rows = [self.windows[i] for i in indices]
                    rows += [np.zeros_like(self.windows[0])] * (self.local_batch_size - len(indices))
                    inputs, labels = pair_batch(np.stack(rows))
                    totals += self.preference.evaluate(model, inputs.to(self.device), labels.to(self.device),
                                                       len(indices))
                    continue
                inputs, labels, docs = padded_batch(self.windows, indices, self.local_batch_size, self.documents)
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                docs = None if docs is None else docs.to(self.device, non_blocking=True)
                if (cp := self.context_parallel) is not None:
                    inputs, labels, docs = cp.shard_batch(inputs, labels, docs)
                if self.pipeline is not None:
                    totals[0] += self.pipeline.evaluate(inputs, labels, docs)[0]
                else:
                    logits = model(inputs) if docs is None else model(inputs, docs)
                    totals[0] += token_loss_sum(logits, labels).double()
                totals[1] += (labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
            reshard_all(model)  # forward passes without backward leave some units gathered
        if dist.is_initialized():
            dist.all_reduce(totals, group=self.group)
        if pairs:
            means = (totals / max(self.num_windows, 1)).tolist()
            return {"validation_loss": means[0], "validation_perplexity": None,
                    "validation_pairs": float(self.num_windows),
                    **{f"validation/{name}": value for name, value in zip(METRICS, means[1:], strict=True)},
                    "validation_time_s": time.perf_counter() - start}
        loss = float(totals[0] / totals[1])
        return {
            "validation_loss": loss,
            "validation_perplexity": math.exp(loss) if loss < 700 else None,
            "validation_tokens": float(totals[1]),
            "validation_time_s": time.perf_counter() - start,
        }
