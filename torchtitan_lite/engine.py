"""The training engine: what an RL framework (veRL, OpenRLHF, AReaL …) or research code drives,
built from the same config and plan as the trainer, on any layout the trainer takes.

    engine = TrainingEngine(load_job_config(argv))      # under torchrun: every rank
    completions = engine.generate(prompt_ids, SamplingParams(max_new_tokens=64), seed=step)
    old = engine.forward_logprobs(inputs, labels)        # (rows, seq), no gradient
    metrics = engine.train_batch(inputs, labels, loss_fn)  # micro-batches inside, one optimizer step
    for name, tensor in engine.export_weights(): ...     # Hugging Face names, full tensors, one at a time
    engine.save(); engine.close()

Rows are this rank's: ``inputs`` and ``labels`` ``(rows, seq)`` (the labels the next tokens where
they are scored, ``-100`` elsewhere). ``loss_fn(part, logp, entropy, labels)`` returns rows
``part``'s share of the step's loss (already divided by whatever makes the shares of all ranks
add up to it; :func:`torchtitan_lite.rl.losses.aggregate` does it for the GRPO family); the engine
back-propagates it with the data-parallel scaling FSDP needs. The built-in GRPO objective runs
its steps through the same runner methods (``rows_logps``, ``rows_backward`` of
:class:`~torchtitan_lite.training.runner.MicroBatchRunner`) and ends them through the same
:meth:`~torchtitan_lite.trainer.Trainer.finish_step`, so a loop written on the engine gives its
losses (``docs/rl.md`` has one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torchtitan_lite.checkpoint.hf_storage import hf_named_tensors
from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.errors import ConfigError
from torchtitan_lite.job import JobPlan
from torchtitan_lite.trainer import Trainer
from torchtitan_lite.training.runner import RowsLoss

__all__ = ["TrainingEngine"]


class TrainingEngine:
    """A job's model, optimizer, schedule and checkpoints (a :class:`~torchtitan_lite.trainer.Trainer`
    built from ``config``: the same checks, layout and resume), driven a batch at a time."""

    def __init__(self, config: JobConfig, plan: JobPlan | None = None) -> None:
        self.trainer = Trainer(config, plan)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed run starts at its checkpoint's)."""
        return self.trainer.step

    @property
    def rank(self) -> int:
        return self.trainer.rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: which rows it takes (tensor-parallel ranks take the same)."""
        return self.trainer.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.trainer.plan.dp_size

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks (the ranks of one tensor-parallel group
        hold the same rows and count once), on this rank's device."""
        import torch.distributed as dist

        value = value.to(self.trainer.device)
        dist.all_reduce(value, group=self.trainer.mesh.tokens)
        return value

    def generate(self, prompts: list[list[int]], params: Any, *, seed: int) -> list[Any]:
        """Completions of ``prompts`` (token ids) by the model as it is now, on its training layout
        (:class:`~torchtitan_lite.rl.rollout.DecoderRollouts`; ``params`` a
        :class:`~torchtitan_lite.rl.rollout.SamplingParams`). Every rank calls it (FSDP gathers in
        each forward)."""
        return self.trainer.rollout_engine.generate(prompts, params, seed=seed)

    def forward_logprobs(self, inputs: torch.Tensor, labels: torch.Tensor, *,
                         temperature: float = 1.0) -> torch.Tensor:
        """Each label's log-probability under the model ``(rows, seq)`` at ``temperature`` (0
        where the label is ``-100``), ``training.local_batch_size`` rows per forward, without
        gradient."""
        t = self.trainer
        return t.runner.rows_logps(inputs, labels, local_batch_size=t.config.training.local_batch_size,
                                   temperature=temperature)

    def train_batch(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: RowsLoss, *,
                    temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's rows: forward and backward ``training.local_batch_size``
        rows at a time through ``loss_fn`` (see the module's text), then clipping, the step and the
        schedule as the trainer takes them. Returns ``loss`` (the step's, summed over the ranks),
        ``grad_norm``, ``lr`` and ``skipped``."""
        t = self.trainer
        if inputs.shape != labels.shape or inputs.dim() != 2:
            raise ValueError(f"train_batch: inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)}; expected "
                             "the same (rows, seq)")
        t.runner.start_step()
        loss_sum = t.runner.rows_backward(inputs, labels, loss_fn, local_batch_size=t.config.training.local_batch_size,
                                          ranks=t.plan.token_ranks, temperature=temperature)
        return t.finish_step(loss_sum, 1.0, global_tokens=int(inputs.numel()) * t.plan.token_ranks)

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each weight under its Hugging Face name as a full tensor, one at a time (LoRA merged),
        in ``dtype`` (default the parameters'): what an inference engine's weight sync loads.
        Every rank iterates it to the end (sharded weights are gathered one at a time)."""
        return hf_named_tensors(self.model, spec=self.trainer.plan.spec, dtype=dtype)

    def save(self) -> Path:
        """A checkpoint of the current step (``checkpoint.enable``; a collective): weights,
        optimizer, schedule, the data position and the trainer's state."""
        t = self.trainer
        if t.checkpointer is None or not t.config.checkpoint.enable:
            raise ConfigError("checkpoint.enable: invalid value False; TrainingEngine.save writes a checkpoint: "
                              "expected true")
        return t.checkpointer.save(t.step, t.train_state(), sync=True)

    def load(self) -> int:
        """Back to the newest checkpoint (the engine resumes from it when built, as the trainer
        does); returns its step."""
        return self.trainer.load_checkpoint()

    def close(self) -> None:
        self.trainer.close()
