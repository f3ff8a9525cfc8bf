"""What every objective is to the loop: :class:`Objective` (a global batch's forward and backward
through the :class:`~torchtitan_lite.training.runner.MicroBatchRunner`, returning a
:class:`StepResult`), and :class:`StatefulObjective` for one whose state a checkpoint keeps. The
trainer's step then clips, steps and logs, the same for every objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from torchtitan_lite.training.runner import MicroBatch, MicroBatchRunner

__all__ = ["Objective", "StatefulObjective", "StepResult"]


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
