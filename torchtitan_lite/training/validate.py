"""Validation loss: no gradients, every rank its own windows, one reduction at the end (of pairs:
the objective's pair loss and its metrics)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_lite.data import PackedPairWindows, PairWindows, pair_batch
from torchtitan_lite.data.windows import (
    Documents,
    PackedWindows,
    TokenWindows,
    num_batches,
    padded_batch,
)
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.loss import token_loss_sum
from torchtitan_lite.training.runner import MicroBatch, MicroBatchRunner

__all__ = ["Validator"]


class Validator:
    """Runs the model over the first ``num_windows`` validation windows, in order.

    ``num_windows`` is ``steps × global_batch_size`` (or the whole set for ``steps = -1``),
    capped at the set's size: it does not depend on the world size when ``global_batch_size``
    does not. Forward pass ``p`` of rank ``r`` reads windows from ``(p·dp_size + r) ·
    local_batch_size``; rows past ``num_windows`` are padding whose labels count nothing, so
    every rank runs the same number of forward passes (FSDP's all-gathers need every rank) and
    the loss is the exact mean over those windows.

    Pairs (:class:`~torchtitan_lite.data.preference.PairWindows`, a window per pair, or
    :class:`~torchtitan_lite.data.preference.PackedPairWindows`) need ``pairs``, the objective that
    scores them (its ``evaluate(runner, batch, pairs)`` and the names of its ``metrics``): the
    loss is then the mean pair loss, with the means of its metrics as ``validation/NAME``.

    Micro-batches run through ``runner`` (:class:`~torchtitan_lite.training.runner.MicroBatchRunner`:
    context parallel's share, the pipeline's forward-only schedule); the sums are reduced over
    ``group`` (None: the default group), the ranks that split the windows' tokens.
    """

    def __init__(
        self,
        windows: TokenWindows | PackedWindows | PairWindows | PackedPairWindows,
        *,
        runner: MicroBatchRunner,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        steps: int,
        documents: Documents | None = None,
        group: Any = None,
        pairs: Any = None,
    ) -> None:
        if isinstance(windows, PairWindows | PackedPairWindows) and pairs is None:
            raise ValueError("Validator: pairs are scored by the objective that trains on them: give pairs")
        self.windows = windows
        self.documents = documents  # block-causal attention over plain windows: the tokenizer's BOS/EOS
        self.runner, self.group, self.pairs = runner, group, pairs
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        wanted = len(windows) if steps == -1 else steps * global_batch_size
        self.num_windows = min(len(windows), wanted)
        self.passes = num_batches(self.num_windows, local_batch_size * dp_size)

    def rank_indices(self, forward_pass: int) -> list[int]:
        """Window indices this rank reads in ``forward_pass`` (fewer than a batch at the end)."""
        first = (forward_pass * self.dp_size + self.dp_rank) * self.local_batch_size
        return list(range(first, min(first + self.local_batch_size, self.num_windows)))

    @torch.no_grad()
    def run(self) -> dict[str, float | None]:
        """Mean loss per token (per pair) over the validation windows (same result on every rank)."""
        start = time.perf_counter()
        model, device = self.runner.model, self.runner.device
        was_training = model.training
        model.eval()
        pairs = isinstance(self.windows, PairWindows | PackedPairWindows)
        names: tuple[str, ...] = tuple(self.pairs.metrics) if pairs else ()
        totals = torch.zeros(2 + len(names), dtype=torch.float64, device=device)
        try:
            for forward_pass in range(self.passes):
                indices = self.rank_indices(forward_pass)
                if pairs:  # padding pairs (or rows): every label ignored, left out of the sums
                    assert self.pairs is not None
                    if isinstance(self.windows, PackedPairWindows):
                        batch = MicroBatch(*padded_batch(self.windows, indices, self.local_batch_size, (None, None)))
                    else:
                        rows = [self.windows[i] for i in indices]
                        rows += [np.zeros_like(self.windows[0])] * (self.local_batch_size - len(indices))
                        batch = MicroBatch(*pair_batch(np.stack(rows)))
                    sums, counted = self.pairs.evaluate(self.runner, batch, len(indices))
                    totals[:-1] += sums
                    totals[-1] += counted
                    continue
                inputs, labels, docs = padded_batch(self.windows, indices, self.local_batch_size, self.documents)
                loss, counted = self.runner.evaluate(MicroBatch(inputs, labels, docs), token_loss_sum)
                totals[0] += loss
                totals[1] += counted
        finally:
            model.train(was_training)
            reshard_all(model)  # forward passes without backward leave some units gathered
        if dist.is_initialized():
            dist.all_reduce(totals, group=self.group)
        if pairs:
            counted = float(totals[-1]) / self.runner.sequence_shards  # (the same pairs on each of them)
            means = (totals[:-1] / max(counted, 1)).tolist()
            return {"validation_loss": means[0], "validation_perplexity": None,
                    "validation_pairs": counted,
                    **{f"validation/{name}": value for name, value in zip(names, means[1:], strict=True)},
                    "validation_time_s": time.perf_counter() - start}
        loss = float(totals[0] / totals[1])
        return {
            "validation_loss": loss,
            "validation_perplexity": math.exp(loss) if loss < 700 else None,
            "validation_tokens": float(totals[1]),
            "validation_time_s": time.perf_counter() - start,
        }
