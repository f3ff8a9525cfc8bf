"""The token objective: the mean token loss over every counted label of the global batch
(next-token prediction; chat SFT with ignored labels), with a mixture's per-source losses and a
mixture of experts' router losses (the runner adds those)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchtitan_lite.objectives.base import StepResult
from torchtitan_lite.objectives.registry import ObjectiveEntry, ObjectiveParts, register
from torchtitan_lite.training.runner import LossFn, MicroBatch, MicroBatchRunner

__all__ = ["TOKEN", "TokenEntry", "TokenObjective"]


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


class TokenEntry(ObjectiveEntry):
    """The token objective's entry: the default when the training data select no other."""

    name = "token"

    def build(self, parts: ObjectiveParts) -> TokenObjective:
        plan, loader = parts.plan, parts.loader
        return TokenObjective(parts.loss_fn, token_ranks=plan.token_ranks, masked=loader.masked,
                              group=parts.mesh.dp_group, loader=loader if loader.named else None,
                              pipeline_degree=plan.dims.pp)


TOKEN = register(TokenEntry())
