"""The one runner of a micro-batch: to the device, context parallel's share, then the pipeline's
schedule or the plain forward, with a mixture of experts' router losses added to the loss.

Every objective (:mod:`torchtitan_lite.objectives`)
and validation (:mod:`torchtitan_lite.training.validate`) run their micro-batches through a
:class:`MicroBatchRunner`; none of them moves a batch, shards it or branches on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from torchtitan_lite.data.loader import MicroBatch
from torchtitan_lite.data.windows import IGNORE_INDEX
from torchtitan_lite.distributed.context_parallel import ContextParallel
from torchtitan_lite.distributed.pipeline_parallel import PipelineRunner, RowsFn
from torchtitan_lite.loss import loss_sums, token_logps
from torchtitan_lite.models.moe.balance import RouterBalance

__all__ = ["LossFn", "MicroBatch", "MicroBatchRunner", "RowsLoss", "sequence_tokens"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(logits, labels)``: a micro-batch's summed loss (a scalar)."""


RowsLoss = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(part, logp, entropy, labels)``: rows ``part``'s share of the step's loss (a scalar),
from their label log-probabilities (with gradient), entropies and labels ``(rows, seq)``."""


def _row_parts(rows: int, local_batch_size: int) -> list[slice]:
    return [slice(i, min(i + local_batch_size, rows)) for i in range(0, rows, local_batch_size)]


def sequence_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Which input positions of rows that each hold one sequence and then padding (a preference
    pair's, a completion's) hold its tokens, ``(rows, seq)`` bool: up to the last one (the token
    after the last counted label), not the padding after it (what a mixture of experts' router
    losses count, as ``transformers`` leaves out what its attention mask does)."""
    positions = torch.arange(labels.shape[1], device=labels.device)
    last = torch.where(labels != IGNORE_INDEX, positions, -1).amax(dim=1)
    return positions[None, :] <= (last + 1)[:, None]


class MicroBatchRunner:
    """Runs micro-batches through ``model`` as the job's layout needs.

    ``context_parallel``: each rank feeds the model its share of every sequence. ``pipeline``:
    the schedule that runs this rank's stages for training (the loss then runs on the last
    stage, inside the schedule); ``evaluation``: its forward-only schedule. ``router_balance``:
    a mixture of experts' router losses, added to each training micro-batch's loss."""

    def __init__(self, model: nn.Module, *, device: torch.device, context_parallel: ContextParallel | None = None,
                 pipeline: PipelineRunner | None = None, evaluation: PipelineRunner | None = None,
                 router_balance: RouterBalance | None = None, num_sources: int = 0, tiled_loss: bool = False) -> None:
        """``num_sources``: the sources of a mixture, for the per-source sums (0: none);
        ``tiled_loss``: the model's output layer takes the labels and returns each one's loss
        (``training.tiled_loss``), so the labels go with the inputs."""
        self.model, self.device, self.tiled_loss = model, device, tiled_loss
        self.context_parallel, self.pipeline, self.evaluation = context_parallel, pipeline, evaluation
        self.reference: tuple[nn.Module, PipelineRunner] | None = None
        """With a pipeline, another model's stages (a frozen reference copy) and their forward-only
        schedule, for :meth:`rows_forward` of that model (:meth:`add_forward_schedules`)."""
        self.router_balance = router_balance
        self.num_sources = num_sources

    @property
    def sequence_shards(self) -> int:
        """The ranks each sequence is split over (context parallel's degree; 1 without it)."""
        return 1 if self.context_parallel is None else self.context_parallel.degree

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a ``(rows, seq)`` tensor, as :meth:`place` cuts each sequence (all
        of it without context parallel)."""
        x = x.to(self.device, non_blocking=True)
        return x if self.context_parallel is None else self.context_parallel.shard(x)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequences of ``(rows, share)`` per-position values of this rank's share
        (:meth:`share`'s inverse, gathered over the context-parallel ranks; ``x`` without context
        parallel), without gradient."""
        if self.context_parallel is None:
            return x
        with torch.no_grad():
            return self.context_parallel.unshard(x.detach())

    def sequence_sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row sums over this rank's share of each sequence ``(rows,)`` as sums over the whole
        sequences: with context parallel, the other ranks' shares are added (summed over the
        context-parallel ranks, without their gradient: each rank's backward takes its own
        share's); without it, ``x``."""
        if self.context_parallel is None:
            return x
        import torch.distributed as dist

        total = x.detach().clone()
        dist.all_reduce(total, group=self.context_parallel.group)
        return x + (total - x.detach())

    def place(self, batch: MicroBatch) -> MicroBatch:
        """``batch`` on the device, cut to this rank's share of each sequence."""
        inputs = batch.inputs.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        docs = None if batch.documents is None else batch.documents.to(self.device, non_blocking=True)
        if self.context_parallel is not None:
            inputs, labels, docs = self.context_parallel.shard_batch(inputs, labels, docs)
        return replace(batch, inputs=inputs, labels=labels, documents=docs)

    def logits(self, batch: MicroBatch, model: nn.Module | None = None) -> torch.Tensor:
        """The logits of a placed ``batch`` (:meth:`place`) by ``model`` (default: the runner's;
        e.g. a frozen reference), without a pipeline (its stages hold parts of the model); with
        ``training.tiled_loss``, each label's loss in their place (the labels handed to it)."""
        if self.pipeline is not None or self.evaluation is not None:
            raise ValueError("MicroBatchRunner.logits: the pipeline's stages hold parts of the model; "
                             "run micro-batches through forward_backward or evaluate")
        model = self.model if model is None else model
        given = {"labels": batch.labels} if self.tiled_loss else {}
        return model(batch.inputs, **given) if batch.documents is None else model(batch.inputs, batch.documents,
                                                                                   **given)

    def add_forward_schedules(self, *, evaluation: PipelineRunner | None,
                              reference: tuple[nn.Module, PipelineRunner] | None) -> None:
        """With a pipeline, the forward-only schedules :meth:`rows_forward` runs: the model's own
        (``evaluation``), and another model's stages with theirs (``reference``)."""
        self.evaluation, self.reference = evaluation, reference

    @torch.no_grad()
    def rows_forward(self, batch: MicroBatch, rows_fn: RowsFn, model: nn.Module | None = None) -> None:
        """Forward only of a placed ``batch`` through ``model`` (default the runner's; e.g. a
        reference), without gradient: ``rows_fn(i, logits, labels, documents)`` of each part of
        its rows the layout runs at once (the whole batch, or each of the pipeline's
        micro-batches, on its last stage's ranks only)."""
        if self.pipeline is None and self.evaluation is None:
            rows_fn(0, self.logits(batch, model), batch.labels, batch.documents)
            return
        if model is None or model is self.model:
            runner = self.evaluation
        else:
            if self.reference is None or self.reference[0] is not model:
                raise ValueError("MicroBatchRunner.rows_forward: no forward-only schedule of that model's stages")
            runner = self.reference[1]
        if runner is None:
            raise ValueError("MicroBatchRunner.rows_forward: no forward-only schedule of the model's stages")
        runner.rows_forward(batch.inputs, batch.labels, rows_fn, documents=batch.documents)

    def rows_forward_backward(self, batch: MicroBatch, rows_fn: RowsFn, *, accumulation: int,
                              labels: torch.Tensor) -> None:
        """Forward and backward of a placed ``batch`` with an objective's own loss: the gradient
        of ``rows_fn(i, logits, labels, documents)`` of each part of its rows the layout runs at
        once (see :meth:`rows_forward`), plus the router losses over the rows' tokens and not
        their padding (:func:`sequence_tokens` of ``labels``, the rows' whole labels)."""
        tokens = self.share(sequence_tokens(labels)) if self.router_balance is not None else None
        if self.pipeline is None:
            loss = rows_fn(0, self.logits(batch), batch.labels, batch.documents)
            self.backward(loss, accumulation=accumulation, tokens=tokens)
            return
        self.pipeline.rows_forward_backward(batch.inputs, batch.labels, rows_fn, accumulation=accumulation,
                                            documents=batch.documents, tokens=tokens)

    def stages_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the pipeline ranks (what only the last stage's ranks computed, on
        every rank); ``x`` without a pipeline."""
        runner = self.pipeline or self.evaluation
        if runner is None:
            return x
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=runner.group)
        return x

    def start_step(self) -> None:
        """Before a step's first micro-batch (the router losses' counts restart)."""
        if self.router_balance is not None:
            self.router_balance.start_step()

    def finish_step(self, *, update_bias: bool) -> dict[str, float]:
        """After the optimizer step: the router losses' metrics (and bias update); empty for a
        dense model."""
        if self.router_balance is None:
            return {}
        return self.router_balance.finish_step(update_bias=update_bias, device=self.device)

    def backward(self, loss: torch.Tensor, *, accumulation: int, tokens: torch.Tensor | None = None) -> None:
        """``loss``'s backward, with the router losses of the forward that made it added (one of
        the step's ``accumulation`` micro-batches; ``tokens``: which of its input positions the
        router losses count, ``(rows, seq)`` bool, None: all)."""
        router = None if self.router_balance is None else self.router_balance.micro_batch_loss(accumulation, tokens)
        (loss if router is None else loss + router).backward()

    def forward_backward(self, batch: MicroBatch, loss_fn: LossFn, *, scale: float,
                         accumulation: int = 1) -> torch.Tensor:
        """Forward and backward of one micro-batch: gradients of ``scale × loss_fn(logits,
        labels)`` (plus the router losses) accumulate. Returns the detached loss sums, fp64
        ``(1 + num_sources,)``: the loss, then each source's share (zeros without ``sources``).
        With a pipeline, ``loss_fn`` is the one its schedule was built with."""
        placed = self.place(batch)
        if self.pipeline is not None:  # every stage's forward and backward, inside the schedule
            part = self.pipeline.forward_backward(placed.inputs, placed.labels, scale=scale,
                                                  documents=placed.documents, sources=placed.sources,
                                                  num_sources=self.num_sources, accumulation=accumulation)
            return self._widen(part)
        logits = self.logits(placed)
        loss = loss_fn(logits, placed.labels)
        sums = loss_sums(loss_fn, logits, placed.labels, loss, placed.sources, self.num_sources)
        del logits  # (the loss's backward frees them once it has run: nothing else holds them)
        self.backward(loss * scale, accumulation=accumulation)
        return self._widen(sums)

    @torch.no_grad()
    def evaluate(self, batch: MicroBatch, loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch forward only: this rank's summed loss (fp64, a scalar tensor) and the
        labels it counted (of this rank's share)."""
        placed = self.place(batch)
        counted = (placed.labels != IGNORE_INDEX).sum()
        if self.evaluation is not None:
            return self.evaluation.evaluate(placed.inputs, placed.labels, placed.documents)[0], counted
        return loss_fn(self.logits(placed), placed.labels).double(), counted

    def counted_labels(self, batch: MicroBatch) -> torch.Tensor:
        """The labels a loss counts in ``batch`` (not ignored), in all then per source, on CPU
        (int64 ``(1 + num_sources,)``)."""
        counts = torch.zeros(1 + self.num_sources, dtype=torch.int64)
        rows = (batch.labels != IGNORE_INDEX).sum(dim=1)
        counts[0] += rows.sum()
        for row, source in enumerate(batch.sources or []):
            counts[1 + source] += rows[row]
        return counts

    # -- rows through the model with a loss of one's own (online RL, the engine) ---------------------

    def rows_logps(self, inputs: torch.Tensor, labels: torch.Tensor, *, local_batch_size: int,
                   temperature: float = 1.0, model: nn.Module | None = None) -> torch.Tensor:
        """Each label's log-probability ``(rows, seq)`` (0 where ignored) under ``model`` (default the
        runner's policy; e.g. a reference) at ``temperature``, ``local_batch_size`` rows per forward,
        without gradient; whole rows on every rank (with context parallel, gathered from the ranks'
        shares)."""
        out = []
        with torch.no_grad():
            for part in _row_parts(inputs.shape[0], local_batch_size):
                placed = self.place(MicroBatch(inputs[part], labels[part]))
                chunks: dict[int, torch.Tensor] = {}

                def keep(i: int, logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                         chunks: dict[int, torch.Tensor] = chunks) -> torch.Tensor:
                    logp, _ = token_logps(logits, labels, temperature=temperature)
                    chunks[i] = self.whole(logp.detach())
                    return logp.sum()

                self.rows_forward(placed, keep, model)  # (with a pipeline: on the last stage's ranks)
                rows = torch.cat([chunks[i] for i in sorted(chunks)]) if chunks else torch.zeros(
                    part.stop - part.start, inputs.shape[1], device=self.device)
                out.append(self.stages_sum(rows))
        return torch.cat(out)

    def rows_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: RowsLoss, *,
                      local_batch_size: int, ranks: int, temperature: float = 1.0) -> torch.Tensor:
        """Forward and backward of this rank's rows, ``local_batch_size`` at a time: each part's label
        log-probabilities at ``temperature`` go to ``loss_fn``, whose value's gradient accumulates
        (times ``ranks``: FSDP averages over the data-parallel ranks, and the parts of all ranks add
        up to the step's loss). Returns the detached sum of the parts, fp64 ``(1,)``."""
        parts = _row_parts(inputs.shape[0], local_batch_size)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for part in parts:
            placed = self.place(MicroBatch(inputs[part], labels[part]))

            def part_loss(i: int, logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                          first: int = part.start) -> torch.Tensor:
                # (rows i·k … of the part, k = the rows the layout runs at once: all, or a pipeline micro-batch's)
                rows = slice(first + i * logits.shape[0], first + (i + 1) * logits.shape[0])
                logp, entropy = token_logps(logits, labels, temperature=temperature, entropy=True)
                assert entropy is not None
                loss = loss_fn(rows, logp, entropy, labels)
                total.add_(loss.detach().double())
                return loss * ranks

            self.rows_forward_backward(placed, part_loss, accumulation=len(parts), labels=labels[part])
        return self.stages_sum(total)

    def _widen(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums of ``(1,)`` (no sources given) to ``(1 + num_sources,)``."""
        if sums.numel() == 1 + self.num_sources:
            return sums
        out = torch.zeros(1 + self.num_sources, dtype=torch.float64, device=sums.device)
        out[0] = sums.reshape(-1)[0]
        return out
