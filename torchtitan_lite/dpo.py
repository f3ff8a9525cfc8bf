"""Direct preference optimization: the losses of TRL's ``DPOTrainer`` (1.16), value for value.

A micro-batch holds pairs as rows: the chosen sequences first, then the rejected ones
(:func:`torchtitan_lite.data.preference.pair_rows`). :func:`sequence_logps` sums each row's
log-probabilities of its counted labels (the answer's tokens) in fp32; :func:`dpo_losses` turns
the policy's and the reference's sums into each pair's loss and rewards:

- ``chosen_scores = logp_policy(chosen) - logp_reference(chosen)``, the same for rejected, and
  ``delta = chosen_scores - rejected_scores``;
- ``sigmoid``: ``-logsigmoid(beta · delta)``; with ``label_smoothing`` ε, conservative DPO
  ``-(1 - ε) · logsigmoid(beta · delta) - ε · logsigmoid(-beta · delta)``;
- ``hinge``: ``relu(1 - beta · delta)``;
- ``ipo``: each score divided by its answer's token count, then ``(delta - 1 / (2 · beta))²``;
- rewards: ``beta · chosen_scores`` and ``beta · rejected_scores`` (unnormalised, for every type).

At the first step, when the policy is the reference, every score is 0: the sigmoid loss is ln 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.distributed.lora import adapters_disabled
from torchtitan_lite.loss import token_loss_sum
from torchtitan_lite.training.objectives import StepResult
from torchtitan_lite.training.runner import MicroBatch, MicroBatchRunner

__all__ = ["LOSS_TYPES", "METRICS", "DPOSetup", "PairLosses", "PreferenceObjective", "as_reference",
           "counted_tokens", "dpo_losses", "sequence_logps"]

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its counted labels (``labels`` not
    :data:`IGNORE_INDEX`), in fp32: ``(rows,)`` from logits ``(rows, seq, vocab)``. Computed a
    row at a time by the training loss's chunked cross-entropy (no full fp32 copy of the logits)."""
    return -torch.stack([token_loss_sum(logits[r:r + 1], labels[r:r + 1]) for r in range(logits.shape[0])])


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's number of counted labels."""
    return (labels != IGNORE_INDEX).sum(dim=-1)


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss and the rewards (``beta`` × the policy's log-ratio to the reference)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
               rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """Each pair's loss of ``loss_type`` (:data:`LOSS_TYPES`) and its rewards, from the summed
    log-probabilities of the policy and the reference (the module's text has the definitions).
    ``ipo`` needs each answer's counted tokens (``chosen_tokens``, ``rejected_tokens``)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r} is not one of {LOSS_TYPES}")
    chosen_scores = chosen_logps - ref_chosen_logps
    rejected_scores = rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type 'ipo' averages over each answer's tokens: give chosen_tokens and "
                             "rejected_tokens")
        delta = chosen_scores / chosen_tokens.clamp(min=1) - rejected_scores / rejected_tokens.clamp(min=1)
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_scores - rejected_scores
        if loss_type == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif label_smoothing:
            loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
        else:
            loss = -F.logsigmoid(beta * delta)
    return PairLosses(loss, beta * chosen_scores.detach(), beta * rejected_scores.detach())


@contextlib.contextmanager
def as_reference(model: nn.Module, reference: nn.Module | None) -> Iterator[nn.Module]:
    """DPO's reference model: the frozen copy ``reference``, or (None) ``model`` itself with its
    LoRA adapters switched off for the duration. The copy's FSDP units are resharded on the way
    out: a forward without a backward would leave some gathered (the root's, and every unit's
    under ``reshard never``) for the rest of the step, and the copy is not needed again until the
    next micro-batch."""
    if reference is not None:
        try:
            yield reference
        finally:
            reshard_all(reference)
        return
    with adapters_disabled(model):
        yield model


@dataclass(frozen=True)
class DPOSetup:
    """A job's preference tuning (``[dpo]`` on ``training.dataset = "preference"``), resolved by the plan."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "copy"
    """``adapters_off`` (the LoRA model with its adapters skipped) or ``copy`` (a frozen copy)."""


METRICS = ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/accuracy", "dpo/margin", "dpo/logps_chosen",
           "dpo/logps_rejected")
"""Each step's means over the global batch's pairs, with TRL's meanings (``rewards/chosen`` …)."""


class PreferenceObjective:
    """DPO's objective (:class:`~torchtitan_lite.training.objectives.Objective`): every micro-batch's
    chosen and rejected rows through the policy (one forward) and through the reference (no
    gradient), the loss of each pair, its gradient scaled to the mean over the ``global_pairs``
    of the global batch (FSDP averages gradients over the ``ranks``), and the means of
    :data:`METRICS` over them (summed over ``group``). ``loader``: a mixture's per-source counts
    (None: no per-source metrics)."""

    def __init__(self, setup: DPOSetup, *, reference: nn.Module | None, ranks: int, global_pairs: int,
                 group: Any = None, loader: Any = None) -> None:
        """``reference``: the frozen copy, or None for the policy with its LoRA adapters off."""
        self.setup, self.ranks, self.global_pairs, self.group = setup, ranks, global_pairs, group
        self.reference, self.loader = reference, loader

    def needs_batch(self) -> bool:
        """Every step reads a new global batch of pairs."""
        return True

    def _pairs(self, runner: MicroBatchRunner, batch: MicroBatch, *, accumulation: int | None = None,
               scale: float = 1.0) -> torch.Tensor:
        """Each pair's loss and :data:`METRICS` ``(pairs, 1 + len(METRICS))`` in fp64 of an
        unplaced micro-batch (chosen rows, then rejected), the same on every rank that runs it;
        with ``accumulation`` (the step's micro-batches), the gradient of ``scale`` × the summed
        pair loss accumulates.

        Each pair's two rows go next to each other, so that every part of the rows the layout runs
        at once (the whole micro-batch, or each of a pipeline's micro-batches, whose last stage
        computes this) holds whole pairs: the reference's forward first, without gradient, then the
        policy's. With context parallel each rank sums its share of every sequence, added over the
        context-parallel ranks; with a pipeline, the last stage's values are summed over the
        pipeline ranks."""
        s, n = self.setup, batch.inputs.shape[0] // 2
        order = torch.stack([torch.arange(n), torch.arange(n, 2 * n)], dim=1).flatten()
        rows = replace(batch, inputs=batch.inputs[order], labels=batch.labels[order], sources=None)
        placed = runner.place(rows)
        refs: dict[int, torch.Tensor] = {}
        results: dict[int, torch.Tensor] = {}

        def reference_logps(i: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            refs[i] = runner.sequence_sums(sequence_logps(logits, labels)).detach()
            return refs[i].sum()

        def pair_loss(i: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logps = runner.sequence_sums(sequence_logps(logits, labels))
            tokens = runner.sequence_sums(counted_tokens(labels))
            ref = refs[i]
            out = dpo_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=s.beta, loss_type=s.loss_type,
                             label_smoothing=s.label_smoothing, chosen_tokens=tokens[0::2],
                             rejected_tokens=tokens[1::2])
            chosen, rejected = out.chosen_rewards.double(), out.rejected_rewards.double()
            policy = logps.detach().double()
            results[i] = torch.stack([out.loss.detach().double(), chosen, rejected, (chosen > rejected).double(),
                                      chosen - rejected, policy[0::2], policy[1::2]], dim=1)
            return out.loss.sum() * scale

        with torch.no_grad(), as_reference(runner.model, self.reference) as reference:
            runner.rows_forward(placed, reference_logps, reference)
        if accumulation is None:
            runner.rows_forward(placed, pair_loss)
        else:
            runner.rows_forward_backward(placed, pair_loss, accumulation=accumulation, labels=rows.labels)
        per_pair = (torch.cat([results[i] for i in sorted(results)]) if results else
                    torch.zeros(n, 1 + len(METRICS), dtype=torch.float64, device=runner.device))
        return runner.stages_sum(per_pair)

    def forward_backward(self, runner: MicroBatchRunner, batch: list[MicroBatch]) -> StepResult:
        """The summed pair loss (with a mixture, then each source's) and the step's
        :data:`METRICS` (every rank the same); the trainer divides the reduced sum by the
        global batch's pairs."""
        scale = self.ranks / max(self.global_pairs, 1)
        loss_sum = torch.zeros(1 + runner.num_sources, dtype=torch.float64, device=runner.device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=runner.device)
        shares = runner.sequence_shards  # (each pair's loss is on every context-parallel rank)
        for mb in batch:
            per_pair = self._pairs(runner, mb, accumulation=len(batch), scale=scale) / shares
            pair_loss = per_pair[:, 0]
            loss_sum[0] += pair_loss.sum()
            if mb.sources is not None and runner.num_sources:  # (the source of each pair)
                loss_sum[1:].index_add_(0, torch.tensor(mb.sources, device=runner.device), pair_loss)
            sums += per_pair[:, 1:].sum(dim=0)
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.group)
        means = (sums / max(self.global_pairs, 1)).tolist()
        tokens = sum(mb.inputs.numel() for mb in batch)
        result = StepResult(loss_sum, self.global_pairs, global_tokens=tokens * self.ranks, tokens_per_rank=tokens,
                            metrics=dict(zip(METRICS, means, strict=True)))
        if self.loader is not None and runner.num_sources:  # per source: its pairs so far, its pairs' loss
            result.source_denominators = list(self.loader.batch_counts)
            result.source_metrics = {f"pairs/{name}": float(n)
                                     for name, n in zip(self.loader.names, self.loader.trained, strict=True)}
        return result

    @torch.no_grad()
    def evaluate(self, runner: MicroBatchRunner, batch: MicroBatch, pairs: int) -> torch.Tensor:
        """The sums of the loss and of :data:`METRICS` over the first ``pairs`` pairs of one
        micro-batch (the rest: padding), without gradients: ``(1 + len(METRICS),)`` in fp64."""
        n = batch.inputs.shape[0] // 2
        keep = (torch.arange(n, device=runner.device) < pairs).double() / runner.sequence_shards
        return (self._pairs(runner, batch) * keep[:, None]).sum(dim=0)
