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

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.config.schema import JobConfig, objective_ranges
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.distributed.job_shape import ObjectiveShape
from torchtitan_lite.errors import ConfigError, Problems
from torchtitan_lite.loss import token_losses
from torchtitan_lite.objectives.base import StepResult
from torchtitan_lite.objectives.reference import add_reference_schedules, as_reference, build_reference, reference_kind
from torchtitan_lite.objectives.registry import ObjectiveEntry, ObjectiveParts, ObjectivePlan, PlanContext, register
from torchtitan_lite.training.runner import MicroBatch, MicroBatchRunner

__all__ = ["DPO", "LOSS_TYPES", "METRICS", "DPOEntry", "DPOSetup", "PairLosses", "PreferenceObjective",
           "counted_tokens", "dpo_losses", "packed_sequences", "per_sequence", "sequence_logps"]

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequences: torch.Tensor | None = None,
                   count: int = 0) -> torch.Tensor:
    """Each sequence's summed log-probability of its counted labels (``labels`` not
    :data:`IGNORE_INDEX`), in fp32: each row's ``(rows,)`` from logits ``(rows, seq, vocab)``, or
    with ``sequences`` (each position's sequence number, ``(rows, seq)``; outside ``[0, count)``:
    none) each of the ``count`` sequences'. The chunked cross-entropy of the training loss
    (:func:`~torchtitan_lite.loss.token_losses`: no full fp32 copy of the logits)."""
    logps = -token_losses(logits, labels)
    return logps.sum(dim=-1) if sequences is None else per_sequence(logps, sequences, count)


def per_sequence(values: torch.Tensor, sequences: torch.Tensor, count: int) -> torch.Tensor:
    """``values`` ``(rows, seq)`` summed per sequence ``(count,)`` (``sequences``: each position's
    sequence number; outside ``[0, count)``: none)."""
    inside = (sequences >= 0) & (sequences < count)
    index = torch.where(inside, sequences, count).flatten()
    values = torch.where(inside, values, torch.zeros_like(values)).flatten()
    return values.new_zeros(count + 1).index_add(0, index, values)[:count]


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's number of counted labels."""
    return (labels != IGNORE_INDEX).sum(dim=-1)


def packed_sequences(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of packed pairs (``dpo.packing``: per row, pair ``k``'s chosen sequence is document
    ``2k``, its rejected one ``2k + 1``, then the padding's) as sequence numbers over the whole
    micro-batch ``(rows, seq)``: pair ``j`` of the micro-batch (row by row) has ``2j`` and
    ``2j + 1``; each row's padding a negative number of its own. Also each row's pairs
    ``(rows,)``. As document ids they give the same block-causal attention and positions."""
    pairs = (documents.amax(dim=1) + 1) // 2
    before = torch.cumsum(pairs, 0) - pairs
    padding = documents >= 2 * pairs[:, None]
    rows = torch.arange(documents.shape[0], device=documents.device)[:, None]
    return torch.where(padding, -1 - rows, documents + 2 * before[:, None]), pairs


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


@dataclass(frozen=True)
class DPOSetup:
    """A job's preference tuning (``[dpo]`` on ``training.dataset = "preference"``), resolved by the plan."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "copy"
    """``adapters_off`` (the LoRA model with its adapters skipped) or ``copy`` (a frozen copy)."""
    packed: bool = False
    """Whole pairs packed into rows (``dpo.packing``; block-causal document ids: pair ``k`` of a
    row its documents ``2k`` and ``2k + 1``), or a pair in two rows of its own."""


METRICS = ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/accuracy", "dpo/margin", "dpo/logps_chosen",
           "dpo/logps_rejected")
"""Each step's means over the global batch's pairs, with TRL's meanings (``rewards/chosen`` …)."""


class PreferenceObjective:
    """DPO's objective (:class:`~torchtitan_lite.objectives.base.Objective`): every micro-batch's
    chosen and rejected sequences through the policy (one forward) and through the reference (no
    gradient), the loss of each pair, its gradient scaled to the mean over the global batch's
    pairs (``global_pairs``; with packed pairs counted at each step over ``group``; FSDP averages
    gradients over the ``ranks``), and the means of :data:`METRICS` over them (summed over
    ``group``). ``loader``: a mixture's per-source counts (None: no per-source metrics)."""

    metrics = METRICS
    """What :meth:`evaluate` sums besides the loss (validation's ``validation/NAME``)."""

    def __init__(self, setup: DPOSetup, *, reference: nn.Module | None, ranks: int, global_pairs: int,
                 group: Any = None, loader: Any = None) -> None:
        """``reference``: the frozen copy, or None for the policy with its LoRA adapters off."""
        self.setup, self.ranks, self.global_pairs, self.group = setup, ranks, global_pairs, group
        self.reference, self.loader = reference, loader

    def needs_batch(self) -> bool:
        """Every step reads a new global batch of pairs."""
        return True

    def _sequences(self, runner: MicroBatchRunner, logits: torch.Tensor, labels: torch.Tensor,
                   documents: torch.Tensor | None,
                   pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The summed log-probabilities and counted tokens ``(2, m)`` of the chosen (row 0) and
        rejected (row 1) sequences of the ``m`` pairs of one part of a placed micro-batch (whole
        sequences: with context parallel, the ranks' shares added), and which of the micro-batch's
        ``pairs`` they are (None: the part's rows are its pairs in order, each pair's rows next to
        each other; with packed pairs, its rows' pairs, by their sequence numbers)."""
        if not self.setup.packed:
            logps = runner.sequence_sums(sequence_logps(logits, labels))
            tokens = runner.sequence_sums(counted_tokens(labels))
            return torch.stack([logps[0::2], logps[1::2]]), torch.stack([tokens[0::2], tokens[1::2]]), None
        assert documents is not None  # (the packed rows' sequence numbers)
        counted = (labels != IGNORE_INDEX).float()
        sums = runner.sequence_sums(torch.stack([
            sequence_logps(logits, labels, documents, 2 * pairs), per_sequence(counted, documents, 2 * pairs),
            per_sequence(torch.ones_like(counted), documents, 2 * pairs)]))
        which = torch.nonzero(sums[2, 0::2] > 0).flatten()  # (a pair's tokens are in this part's rows)
        return sums[0].view(-1, 2)[which].T, sums[1].view(-1, 2)[which].T, which

    def _pairs(self, runner: MicroBatchRunner, batch: MicroBatch, *, accumulation: int | None = None,
               scale: float = 1.0) -> torch.Tensor:
        """Each pair's loss and :data:`METRICS` ``(pairs, 1 + len(METRICS))`` in fp64 of an
        unplaced micro-batch, the same on every rank that runs it; with ``accumulation`` (the
        step's micro-batches), the gradient of ``scale`` × the summed pair loss accumulates.

        Every part of the rows the layout runs at once (the whole micro-batch, or each of a
        pipeline's micro-batches, whose last stage computes this) holds whole pairs: a pair's two
        rows are put next to each other (chosen rows, then rejected, as the loader gives them), and
        packed pairs share a row. The reference's forward runs first, without gradient, then the
        policy's. With context parallel each rank sums its share of every sequence, added over the
        context-parallel ranks; with a pipeline, the last stage's values are summed over the
        pipeline ranks."""
        s = self.setup
        if s.packed:
            if batch.documents is None:
                raise ValueError("PreferenceObjective: packed pairs need their rows' document ids")
            sequences, per_row = packed_sequences(batch.documents)
            n = int(per_row.sum())
            rows = replace(batch, documents=sequences, sources=None)
        else:
            n = batch.inputs.shape[0] // 2
            order = torch.stack([torch.arange(n), torch.arange(n, 2 * n)], dim=1).flatten()
            rows = replace(batch, inputs=batch.inputs[order], labels=batch.labels[order], sources=None)
        placed = runner.place(rows)
        refs: dict[int, torch.Tensor] = {}
        results: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

        def reference_logps(i: int, logits: torch.Tensor, labels: torch.Tensor,
                            documents: torch.Tensor | None) -> torch.Tensor:
            logps, _, _ = self._sequences(runner, logits, labels, documents, n)
            refs[i] = logps.detach()
            return logps.sum()

        def pair_loss(i: int, logits: torch.Tensor, labels: torch.Tensor,
                      documents: torch.Tensor | None) -> torch.Tensor:
            logps, tokens, which = self._sequences(runner, logits, labels, documents, n)
            ref = refs[i]
            out = dpo_losses(logps[0], logps[1], ref[0], ref[1], beta=s.beta, loss_type=s.loss_type,
                             label_smoothing=s.label_smoothing, chosen_tokens=tokens[0], rejected_tokens=tokens[1])
            chosen, rejected = out.chosen_rewards.double(), out.rejected_rewards.double()
            policy = logps.detach().double()
            results[i] = which, torch.stack([out.loss.detach().double(), chosen, rejected,
                                             (chosen > rejected).double(), chosen - rejected, policy[0], policy[1]], 1)
            return out.loss.sum() * scale

        with torch.no_grad(), as_reference(runner.model, self.reference) as reference:
            runner.rows_forward(placed, reference_logps, reference)
        if accumulation is None:
            runner.rows_forward(placed, pair_loss)
        else:
            runner.rows_forward_backward(placed, pair_loss, accumulation=accumulation, labels=rows.labels)
        per_pair = torch.zeros(n, 1 + len(METRICS), dtype=torch.float64, device=runner.device)
        if s.packed:
            for which, values in results.values():
                per_pair[which] = values
        elif results:
            per_pair = torch.cat([results[i][1] for i in sorted(results)])
        return runner.stages_sum(per_pair)

    def _pair_counts(self, runner: MicroBatchRunner, batch: list[MicroBatch],
                     per_row: list[torch.Tensor] | None) -> tuple[float, list[float]]:
        """The global batch's pairs, and each source's (a mixture): fixed without packing; packed
        pairs counted in this rank's rows (``per_row``: each micro-batch's pairs a row), summed
        over ``group`` (one all-reduce)."""
        if per_row is None:
            return float(self.global_pairs), [float(n) for n in getattr(self.loader, "batch_counts", [])]
        counts = torch.zeros(1 + runner.num_sources, dtype=torch.float64)
        for mb, pairs in zip(batch, per_row, strict=True):
            counts[0] += pairs.sum()
            if mb.sources is not None and runner.num_sources:
                counts[1:].index_add_(0, torch.tensor(mb.sources), pairs.double())
        counts = counts.to(runner.device)
        if dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        counts = (counts / runner.sequence_shards).tolist()  # (every context-parallel rank holds the same rows)
        return counts[0], counts[1:]

    def forward_backward(self, runner: MicroBatchRunner, batch: list[MicroBatch]) -> StepResult:
        """The summed pair loss (with a mixture, then each source's) and the step's
        :data:`METRICS` (every rank the same); the trainer divides the reduced sum by the
        global batch's pairs."""
        per_row = None  # (packed pairs: each micro-batch's pairs a row)
        if self.setup.packed:
            if any(mb.documents is None for mb in batch):
                raise ValueError("PreferenceObjective: packed pairs need their rows' document ids")
            per_row = [packed_sequences(mb.documents)[1] for mb in batch if mb.documents is not None]
        global_pairs, source_pairs = self._pair_counts(runner, batch, per_row)
        scale = self.ranks / max(global_pairs, 1)
        loss_sum = torch.zeros(1 + runner.num_sources, dtype=torch.float64, device=runner.device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=runner.device)
        shares = runner.sequence_shards  # (each pair's loss is on every context-parallel rank)
        for index, mb in enumerate(batch):
            per_pair = self._pairs(runner, mb, accumulation=len(batch), scale=scale) / shares
            pair_loss = per_pair[:, 0]
            loss_sum[0] += pair_loss.sum()
            if mb.sources is not None and runner.num_sources:  # (the source of each pair)
                sources = torch.tensor(mb.sources)
                if per_row is not None:
                    sources = sources.repeat_interleave(per_row[index])
                loss_sum[1:].index_add_(0, sources.to(runner.device), pair_loss)
            sums += per_pair[:, 1:].sum(dim=0)
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.group)
        means = (sums / max(global_pairs, 1)).tolist()
        tokens = sum(mb.inputs.numel() for mb in batch)
        metrics: dict[str, float | None] = dict(zip(METRICS, means, strict=True))
        if self.setup.packed:
            metrics["dpo/pairs"] = global_pairs
        result = StepResult(loss_sum, max(global_pairs, 1), global_tokens=tokens * self.ranks,
                            tokens_per_rank=tokens, metrics=metrics)
        if self.loader is not None and runner.num_sources:  # per source: its pairs (rows) so far, its pairs' loss
            result.source_denominators = source_pairs
            unit = "rows" if self.setup.packed else "pairs"
            result.source_metrics = {f"{unit}/{name}": float(n)
                                     for name, n in zip(self.loader.names, self.loader.trained, strict=True)}
        return result

    @torch.no_grad()
    def evaluate(self, runner: MicroBatchRunner, batch: MicroBatch, pairs: int) -> tuple[torch.Tensor, int]:
        """The sums of the loss and of :data:`METRICS` over the pairs of one micro-batch whose
        first ``pairs`` pairs (rows of packed pairs) are real (the rest: padding), without
        gradients: ``(1 + len(METRICS),)`` in fp64, and how many pairs they are."""
        per_pair = self._pairs(runner, batch) / runner.sequence_shards
        if self.setup.packed:  # (padding rows hold no pair)
            return per_pair.sum(dim=0), per_pair.shape[0]
        keep = (torch.arange(per_pair.shape[0], device=runner.device) < pairs).double()
        return (per_pair * keep[:, None]).sum(dim=0), pairs


class DPOEntry(ObjectiveEntry):
    """DPO's entry: on preference pairs (``[dpo]``)."""

    name = "dpo"
    section = "dpo"
    data_kinds = frozenset({"preference"})

    def check_idle(self, config: JobConfig, problems: Problems) -> None:
        super().check_idle(config, problems)
        v = config.validation
        kinds = ([s.dataset for s in v.datasets] or [v.dataset]) if v.enable else []
        problems.require("preference" not in kinds, "validation.datasets" if v.datasets else "validation.dataset",
                         kinds, "preference pairs are validated by a DPO job (training.dataset = 'preference'); "
                         "expected a text, token or chat source")

    def plan(self, config: JobConfig, context: PlanContext) -> ObjectivePlan:
        d, t, v = config.dpo, config.training, config.validation
        train_kinds = [s.dataset for s in t.datasets] or [t.dataset]
        val_kinds = ([s.dataset for s in v.datasets] or [v.dataset]) if v.enable else []
        problems = Problems()
        objective_ranges(config, problems.require, sections=("dpo",))  # (a config built in code: checked here)
        problems.require(set(train_kinds) == {"preference"}, "training.datasets" if t.datasets else "training.dataset",
                         train_kinds if t.datasets else t.dataset,
                         "a DPO mixture is of preference sources only: expected every dataset = 'preference'"
                         if t.datasets else "DPO reads preference pairs: expected 'preference'")
        problems.require(set(val_kinds) <= {"preference"}, "validation.datasets" if v.datasets else
                         "validation.dataset", val_kinds, "a DPO job validates on preference pairs: expected dataset "
                         "= 'preference'")
        try:
            reference = reference_kind(d.reference, lora=context.lora is not None, key="dpo.reference")
        except ConfigError as exc:
            problems.add(exc)
            reference = "copy"
        problems.require(not d.packing or config.model.attention_mask == "block_causal", "dpo.packing", d.packing,
                         f"packed pairs attend each to itself only: needs model.attention_mask = 'block_causal' "
                         f"(this job's is {config.model.attention_mask!r}), or expected false")
        problems.raise_all()
        setup = DPOSetup(beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing, reference=reference,
                         packed=d.packing)
        # (each sample a pair of rows, chosen and rejected, or with packing a row of pairs; the
        # reference's forward of a micro-batch before the policy's)
        shape = ObjectiveShape(rows_per_sample=1 if d.packing else 2, reference=reference, reference_forward=True)
        return ObjectivePlan(self, setup, shape)

    def build(self, parts: ObjectiveParts) -> PreferenceObjective:
        plan, setup = parts.plan, parts.plan.objective.setup
        reference = build_reference(parts.config, plan, setup.reference, mesh=parts.mesh, device=parts.device,
                                    reshard_plan=parts.reshard_plan)
        return PreferenceObjective(setup, reference=reference, ranks=plan.token_ranks,
                                   global_pairs=plan.global_batch_size, group=parts.mesh.tokens,
                                   loader=parts.loader if parts.loader.named else None)

    def add_forward_schedules(self, objective: Any, runner: MicroBatchRunner, parts: ObjectiveParts, *,
                              local_batch_size: int) -> None:
        add_reference_schedules(objective.reference, runner, parts, local_batch_size=local_batch_size)

    def pair_scorer(self, objective: Any) -> PreferenceObjective:
        return objective

    def batch_text(self, plan: ObjectivePlan, local_batch_size: int) -> str:
        return (f"{local_batch_size} rows of packed pairs" if plan.setup.packed
                else f"{local_batch_size} pairs ({2 * local_batch_size} rows)")

    def sequence_text(self, plan: ObjectivePlan) -> str:
        return (" for a row of packed pairs (a pair's two sequences together)" if plan.setup.packed
                else " for each of a pair's two sequences (prompt and answer)")

    def step_lines(self, plan: ObjectivePlan) -> list[str]:
        setup = plan.setup
        rows = "its rows of whole pairs (block-causal)" if setup.packed else "each pair's chosen and rejected rows"
        return [f"DPO ({setup.loss_type}): {rows} in one forward, after the reference's forward without gradients; "
                "the reference is " + ("the same weights with the LoRA adapters off (no second copy)"
                                       if setup.reference == "adapters_off" else
                                       "a frozen copy sharded like the model (its shards counted as sharded params)")]

    def console(self, record: dict[str, Any]) -> list[str]:
        """TRL's reward metrics: accuracy, margin, the two rewards."""
        if record.get("dpo/accuracy") is None:
            return []
        return [f"acc {record['dpo/accuracy']:.2f}  margin {record['dpo/margin']:.4f}  rewards "
                f"{record['dpo/rewards_chosen']:.4f} / {record['dpo/rewards_rejected']:.4f}"]

    def validation_console(self, record: dict[str, Any]) -> str | None:
        """Preference pairs: the reward accuracy, not a perplexity."""
        if record.get("validation/dpo/accuracy") is None:
            return None
        return f"val_loss {record['validation_loss']:8.4f} val_acc {record['validation/dpo/accuracy']:.2f}"


DPO = register(DPOEntry())
