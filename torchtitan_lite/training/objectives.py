"""What a training step optimises: an objective runs one global batch's micro-batches (this
rank's) forward and backward through the :class:`~torchtitan_lite.training.runner.MicroBatchRunner`
and returns a :class:`StepResult`; the trainer's step then clips, steps and logs, the same for
every objective.

- :class:`TokenObjective`: the mean token loss over the global batch (next-token prediction,
  chat SFT with ignored labels), with a mixture's per-source losses and a mixture of experts'
  router losses;
- :class:`~torchtitan_lite.dpo.PreferenceObjective`: DPO's pair loss against a reference;
- :class:`~torchtitan_lite.rl.grpo.GRPOObjective`: online RL's policy loss on its own rollouts.

A new objective (distillation, a z-loss) is a class with ``needs_batch`` and ``forward_backward``
(:class:`Objective`); the loop does not change (``docs/research.md`` has one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from torchtitan_lite.training.runner import LossFn, MicroBatch, MicroBatchRunner

__all__ = ["Objective", "StatefulObjective", "StepResult", "TokenObjective"]


@dataclass
class StepResult:
    """One global batch's forward and backward, as the trainer's step needs it."""

    loss_sum: torch.Tensor
    """This rank's summed loss, fp64 ``(1 + sources,)``: the sum, then each source's (a mixture);
    the optimizer step reduces it over the ranks in place and divides the sum by
    :attr:`denominator` for the logged ``loss``."""
    denominator: float
    """What the reduced sum is divided by: the counted tokens, or pairs, of the global batch."""
    global_tokens: int
    """Tokens the step trained on over all ranks (``tokens_seen`` grows by it)."""
    tokens_per_rank: float
    """Tokens this rank ran (for tokens/s and MFU)."""
    metrics: dict[str, float | None] = field(default_factory=dict)
    """The objective's own metrics, the same on every rank."""
    source_denominators: list[float] = field(default_factory=list)
    """Per source: what its reduced sum is divided by for ``loss/NAME`` (empty: no per-source losses)."""
    source_metrics: dict[str, float] = field(default_factory=dict)
    """Per source: its progress (``tokens/NAME``, ``pairs/NAME``)."""

    def source_losses(self, names: list[str]) -> dict[str, float | None]:
        """``loss/NAME`` of each source, once :attr:`loss_sum` is reduced (None: no sample of it)."""
        sums = self.loss_sum.reshape(-1)
        return {f"loss/{name}": float(sums[1 + i].item() / count) if count else None
                for i, (name, count) in enumerate(zip(names, self.source_denominators, strict=True))}


class Objective(Protocol):
    """What a training step optimises (see the module's text)."""

    def needs_batch(self) -> bool:
        """Whether the next step reads a new global batch (online RL trains on one batch's
        rollouts for several steps)."""
        ...

    def forward_backward(self, runner: MicroBatchRunner, batch: list[MicroBatch]) -> StepResult:
        """Forward and backward over this rank's micro-batches of one global batch, gradients
        scaled so that the step's are those of the objective's mean over the global batch (FSDP
        averages them over the data-parallel ranks)."""
        ...


@runtime_checkable
class StatefulObjective(Protocol):
    """An objective with state of its own that a checkpoint keeps (online RL's rollouts in
    progress): the trainer saves every rank's :meth:`state_dict` and gives each rank its own back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, same_ranks: bool = True) -> None:
        """``state`` as saved by this rank (``same_ranks``), or by rank 0 of another world size."""
        ...


class TokenObjective:
    """The mean token loss over every counted label of the global batch.

    ``loss_fn``: the summed token loss (:func:`~torchtitan_lite.loss.token_loss_sum`, perhaps
    compiled); ``token_ranks``: the ranks that split the global batch's tokens (data × context
    parallel: FSDP averages the gradients over them); ``masked``: some labels are ignored (chat
    SFT: the gradients are then those of the mean over the counted ones, one all-reduce of the
    counts over ``group``); ``loader``: a mixture's per-source counts (None: no per-source
    metrics); ``pipeline_degree``: a pipeline rank runs 1 / degree of the model over its tokens."""

    def __init__(self, loss_fn: LossFn, *, token_ranks: int, masked: bool = False, group: Any = None,
                 loader: Any = None, pipeline_degree: int = 1) -> None:
        self.loss_fn, self.token_ranks, self.masked, self.group = loss_fn, token_ranks, masked, group
        self.loader, self.pipeline_degree = loader, pipeline_degree

    def needs_batch(self) -> bool:
        """Every step reads a new global batch."""
        return True

    def forward_backward(self, runner: MicroBatchRunner, batch: list[MicroBatch]) -> StepResult:
        counted = self._counted(runner, batch) if self.masked else None
        tokens = sum(mb.labels.numel() for mb in batch) // runner.sequence_shards
        # FSDP averages gradients over the ranks: scaled by ranks / counted labels, they are the
        # gradient of the mean over every counted label of the global batch.
        scale = 1 / tokens if counted is None else self.token_ranks / max(int(counted[0]), 1)
        loss_sum = torch.zeros(1 + runner.num_sources, dtype=torch.float64, device=runner.device)
        for mb in batch:
            loss_sum += runner.forward_backward(mb, self.loss_fn, scale=scale, accumulation=len(batch))
        global_tokens = tokens * self.token_ranks
        result = StepResult(loss_sum, global_tokens if counted is None else max(int(counted[0]), 1),
                            global_tokens=global_tokens, tokens_per_rank=tokens / self.pipeline_degree)
        if self.loader is not None and runner.num_sources:  # per source: its tokens so far, its samples' loss
            seq_len = self.loader.seq_len
            result.source_denominators = [self.loader.batch_counts[i] * seq_len if counted is None
                                          else int(counted[1 + i]) for i in range(runner.num_sources)]
            result.source_metrics = {f"tokens/{name}": float(n) for name, n in self.loader.tokens_by_source().items()}
        return result

    def _counted(self, runner: MicroBatchRunner, batch: list[MicroBatch]) -> torch.Tensor:
        """Labels the loss counts in this global batch over all ranks: in all, then per source
        (one all-reduce)."""
        counts = sum((runner.counted_labels(mb) for mb in batch),
                     torch.zeros(1 + runner.num_sources, dtype=torch.int64)).to(runner.device)
        dist.all_reduce(counts, group=self.group)
        return counts.cpu()
