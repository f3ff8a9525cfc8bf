"""What a training step is made of, as one object: :class:`JobShape`.

The job plan (:func:`torchtitan_lite.job.plan_job`) builds it once from the config and the world;
the model's build (:func:`~torchtitan_lite.distributed.parallelize.build_sharded_model`), the
memory estimate (:func:`torchtitan_lite.memory.estimate.estimate_memory`) and ``auto``
(:func:`torchtitan_lite.memory.auto.plan_auto_reshard`) take it, each reading the fields it
models. A field added here (a new parallel degree) reaches all three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_lite.distributed.compile import compiles_by_parts
from torchtitan_lite.distributed.float8 import Float8Conversion
from torchtitan_lite.distributed.fsdp import FSDPOptions, ReshardMode
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.distributed.pipeline_parallel import PipelinePlan

__all__ = ["JobShape", "ObjectiveShape", "RolloutShape"]


@dataclass(frozen=True)
class RolloutShape:
    """What an online RL step (:mod:`torchtitan_lite.rl`) holds beyond a token-loss step of the
    same rows: its completions generated on the training model with a KV cache, the
    log-probabilities it keeps of each completion's tokens (the sampling policy's and the
    reference's), and the per-row log-softmax of its policy loss."""

    generation_rows: int = 0
    """Completions generated at once on a rank (``grpo.generation_batch_size``, or all of a step's);
    0: none (``grpo.rollouts_path``: the completions are given)."""
    prompt_len: int = 0
    """The longest prompt, in tokens (``training.seq_len − grpo.max_completion_length``)."""
    new_tokens: int = 0
    """Tokens generated at most per completion (``grpo.max_completion_length``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    old_logps: bool = False
    """The sampling policy's log-probabilities are computed and kept (``grpo.num_iterations`` > 1,
    or given sampling log-probabilities)."""


@dataclass(frozen=True)
class ObjectiveShape:
    """What a step of the job's objective (:mod:`torchtitan_lite.objectives`) holds beyond a
    token-loss step of the same rows, as the memory estimate and the build need it; the defaults
    are the token loss's."""

    rows_per_sample: int = 1
    """Rows a sample is (2: a pair of sequences, chosen and rejected, in two rows)."""
    reference: str | None = None
    """The frozen reference: ``copy`` (a copy sharded like the model), ``adapters_off`` (the model
    with its LoRA adapters off) or None (none)."""
    reference_forward: bool = False
    """Each micro-batch runs through the reference (no gradient) before the policy's forward."""
    rollout: RolloutShape | None = None
    """Each step's rows are completions generated on the training model (:class:`RolloutShape`);
    None: the rows come from the data."""
    step: Callable[..., int] | None = None
    """The memory estimate's step of an objective that generates (its module's function, called
    on fake tensors under the estimate's tracker; returns its KV cache's bytes); None: the token
    step over the objective's rows."""


@dataclass(frozen=True)
class JobShape:
    """One training step's shape: the world and its degrees, the batch, dtypes, sharding,
    checkpointing, compile, float8, LoRA and the optimizer."""

    world_size: int = 1
    """Ranks of the job."""
    dp_replicate: int = 1
    """HSDP replicas (the data-parallel shard degree is what the others leave of the world)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree."""
    expert_parallel: int = 1
    """Expert-parallel degree."""
    context_parallel: int = 1
    """Context-parallel degree: ranks each sequence is split over."""
    context_parallel_method: str = "allgather"
    """``parallelism.context_parallel_method``."""
    device_type: str = "cuda"
    """Where the job runs, for what its attention holds: a context-parallel mask is a BlockMask of
    next to nothing on CUDA and a dense boolean mask on a CPU."""
    block_causal: bool = False
    """Packed documents attend each to itself (``model.attention_mask = "block_causal"``): each
    forward takes document ids, and off CUDA builds a dense ``(rows, seq, seq)`` mask."""
    local_batch_size: int = 1
    """Samples per rank per micro-batch."""
    seq_len: int = 2048
    """Tokens per sample."""
    grad_accum_steps: int = 1
    """Micro-batches per rank per optimizer step."""
    param_dtype: torch.dtype = torch.float32
    """Dtype of gathered parameters and of compute."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype of gradient reduction."""
    reshard_after_forward_mode: ReshardMode | str = "default"
    """A named mode, an integer group size or one bool per FSDP unit (``"auto"`` until planned)."""
    cpu_offload: bool | tuple[bool, ...] | str = False
    """Every unit, one bool per unit, or ``"auto"`` (``auto`` chooses per unit)."""
    ac_mode: str = "none"
    """``activation_checkpoint.mode``."""
    selective_ac_option: str | int = "op"
    """``activation_checkpoint.selective_ac_option``."""
    ac_policies: tuple[str, ...] | None = None
    """One of ``none``/``full``/``op`` per block (``auto``'s choice), instead of the two above."""
    activation_offload: bool = False
    """``activation_checkpoint.offload``: checkpointed blocks' inputs kept in host memory."""
    mlp_tiles: int = 1
    """``activation_checkpoint.mlp_tiles``: dense feed-forwards over sequence tiles (1: off, 0: chosen)."""
    tiled_loss: bool = False
    """``training.tiled_loss``: the output layer returns each label's loss, made over row tiles."""
    lora: LoRASetup | None = None
    """Adapters on the linears, the rest frozen."""
    loss_parallel: bool = True
    """Under tensor parallel, the logits stay split over the vocabulary for the loss."""
    optimizer: str = "AdamW"
    """``optimizer.name``."""
    optimizer_implementation: str = "foreach"
    """``optimizer.implementation``."""
    compile_model: bool = False
    """Blocks compiled (the build; the estimate models the eager job)."""
    compile_backend: str = "inductor"
    """``compile.backend``."""
    float8: Float8Conversion | None = None
    """The float8 conversion (the build; the estimate models the job without it)."""
    async_tensor_parallel: bool = False
    """Inductor overlaps tensor-parallel collectives with the matmuls (CUDA, compiled blocks)."""
    sharded: bool = True
    """FSDP2 shards the model (more than one rank, or CPU offload); else one process trains the
    plain model, under autocast for a lower compute dtype."""
    objective_shape: ObjectiveShape = ObjectiveShape()
    """What the objective's step holds beyond a token-loss step (:class:`ObjectiveShape`)."""
    pipeline: PipelinePlan | None = None
    """Pipeline parallel: the stages and the schedule; each rank builds its pipeline coordinate's
    stages only (None: no pipeline)."""

    def replace(self, **changes: Any) -> JobShape:
        """The shape with ``changes``."""
        return dataclasses.replace(self, **changes)

    @property
    def pipeline_degree(self) -> int:
        """Pipeline ranks (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.degree

    def fsdp_options(self) -> FSDPOptions | None:
        """How FSDP2 shards the model (None: it does not)."""
        if not self.sharded:
            return None
        if self.cpu_offload == "auto":
            raise ValueError("cpu_offload = 'auto' needs the per-unit plan auto chose")
        return FSDPOptions(reshard_after_forward_mode=self.reshard_after_forward_mode,
                           param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                           cpu_offload=self.cpu_offload)

    @property
    def compile_by_parts(self) -> bool:
        """Blocks compiled by their parts (:func:`~.compile.compiles_by_parts`)."""
        return compiles_by_parts(compile_model=self.compile_model, expert_parallel=self.expert_parallel)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The compute dtype of an unsharded model's autocast (None: sharded, or fp32)."""
        return None if self.sharded or self.param_dtype == torch.float32 else self.param_dtype
