"""The frozen reference model of an objective (DPO's, online RL's KL term): a copy of the starting
weights built and sharded like the policy, or the policy itself with its LoRA adapters off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from torchtitan_lite.checkpoint.storage import CheckpointStorage
from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.distributed import ParallelMesh
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.distributed.lora import adapters_disabled
from torchtitan_lite.distributed.parallelize import build_parallelized
from torchtitan_lite.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from torchtitan_lite.objectives.registry import ObjectiveParts
    from torchtitan_lite.training.runner import MicroBatchRunner

__all__ = ["REFERENCES", "add_reference_schedules", "as_reference", "build_reference", "reference_kind"]

REFERENCES = ("auto", "copy", "adapters_off")
"""What a reference may be (``dpo.reference``, ``grpo.reference``): ``auto`` picks ``adapters_off``
for a LoRA job and ``copy`` otherwise."""


def reference_kind(setting: str, *, lora: bool, key: str) -> str:
    """``setting`` (:data:`REFERENCES`) resolved for a job with or without LoRA; one
    :class:`~torchtitan_lite.errors.ConfigError` line naming ``key`` for ``adapters_off`` without it."""
    if setting == "auto":
        return "adapters_off" if lora else "copy"
    if setting == "adapters_off" and not lora:
        raise ConfigError(f"{key}: invalid value {setting!r}; switching adapters off needs LoRA (lora.enable = "
                          "true); expected 'copy' or 'auto'")
    return setting


@contextlib.contextmanager
def as_reference(model: nn.Module, reference: nn.Module | None) -> Iterator[nn.Module]:
    """An objective's reference model (DPO's, online RL's KL term): the frozen copy ``reference``,
    or (None) ``model`` itself with its LoRA adapters switched off for the duration. The copy's
    FSDP units are resharded on the way out: a forward without a backward would leave some
    gathered (the root's, and every unit's under ``reshard never``) for the rest of the step, and
    the copy is not needed again until the next micro-batch."""
    if reference is not None:
        try:
            yield reference
        finally:
            reshard_all(reference)
        return
    with adapters_disabled(model):
        yield model


def build_reference(config: JobConfig, plan: Any, kind: str | None, *, mesh: ParallelMesh, device: torch.device,
                    reshard_plan: Any = None) -> nn.Module | None:
    """The reference model of an objective (``kind``; ``plan`` the :class:`~torchtitan_lite.job.JobPlan`,
    ``reshard_plan`` what ``auto`` chose): None for ``adapters_off`` (the policy
    with its LoRA adapters switched off is its own) or no reference; for ``copy`` a frozen copy of
    the starting weights built and sharded like the policy (from ``debug.seed``, or
    ``checkpoint.initial_load_path``, a Hugging Face folder or a DCP checkpoint: on every start,
    resumes included), never trained or saved."""
    if kind != "copy":
        return None
    shape = plan.shape if reshard_plan is None else reshard_plan.applied_to(plan.shape)
    reference = build_parallelized(plan.spec, plan.model_args, mesh, device=device, seed=config.debug.seed,
                                   shape=shape).model
    reference.train()
    reference.requires_grad_(False)
    ck = config.checkpoint
    if ck.initial_load_path is not None:
        storage = CheckpointStorage(model=reference, optimizer=None, model_spec=plan.spec, lora=None, hf_extras=None)
        storage.load_weights(Path(ck.initial_load_path), "hf" if ck.initial_load_in_hf else "dcp", {"model"})
    return reference


def add_reference_schedules(reference: nn.Module | None, runner: MicroBatchRunner, parts: ObjectiveParts, *,
                            local_batch_size: int) -> None:
    """With a pipeline, the forward-only schedules of ``local_batch_size`` rows that an objective
    with a reference runs on ``runner``: the policy's (the sampling policy's log-probabilities, the
    reference with adapters off, validation's forward) and the frozen copy's stages'. Nothing
    without a pipeline."""
    if parts.forward_schedule is None:
        return
    forward = parts.forward_schedule
    runner.add_forward_schedules(evaluation=runner.evaluation or forward(runner.model, local_batch_size),
                                 reference=None if reference is None else (reference, forward(reference,
                                                                                               local_batch_size)))
