"""The meta-init path of a registered model: build on the meta device, parallelize, allocate,
initialise. :func:`build_sharded_model` is the one way a model is built, for the trainer, the
memory estimator and ``auto`` alike.

:func:`parallelize` is the one path, in TorchTitan's order: LoRA adapts the linears first (the
adapters are then parameters of their blocks like any other: checkpointed, compiled and sharded
with them), the float8 conversion swaps the blocks' other linears next (so that all that follows
wraps the converted layers: tensor parallel splits them with torchao's float8 styles), tensor and
expert parallel split the layers, activation checkpointing wraps each block's forward (so that
compile traces the checkpoint as part of the block's graph), compile comes next, and
``fully_shard`` last (so that its hooks, which gather and free parameters, stay outside the
compiled code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.distributed.activation_checkpoint import BlockPolicy, apply_activation_checkpointing
from torchtitan_lite.distributed.autocast import apply_autocast
from torchtitan_lite.distributed.compile import compile_blocks
from torchtitan_lite.distributed.expert_parallel import shard_experts
from torchtitan_lite.distributed.float8 import Float8Conversion
from torchtitan_lite.distributed.fsdp import (
    ExpertShards,
    FSDPOptions,
    FSDPUnit,
    apply_fsdp,
    fsdp_units,
    materialize,
)
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.distributed.mesh import ParallelMesh
from torchtitan_lite.distributed.tensor_parallel import (
    apply_decoder_tensor_parallel,
    enable_async_tensor_parallel,
)
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["ParallelizeOptions", "build_sharded_model", "parallelize"]


@dataclass(frozen=True)
class ParallelizeOptions:
    """What a job asks of a model's parallelize steps."""

    ac_mode: str = "none"
    """TorchTitan's ``activation_checkpoint.mode``."""
    selective_ac_option: str | int = "op"
    ac_policies: Sequence[BlockPolicy] | None = None
    """One of ``none``/``full``/``op`` per block (``auto``'s choice), instead of the two above."""
    compile_model: bool = False
    compile_backend: str = "inductor"
    float8: Float8Conversion | None = None
    fsdp: FSDPOptions | None = FSDPOptions()  # frozen
    """How to shard; None: one process, the model kept plain (allocated whole)."""
    autocast_dtype: torch.dtype | None = None
    """Without FSDP: run the forward under autocast in this dtype (bf16 on one process)."""
    lora: LoRASetup | None = None
    loss_parallel: bool = True
    """Under tensor parallel: the logits stay split over the vocabulary for the loss."""
    async_tensor_parallel: bool = False
    """Under tensor parallel with compiled blocks on CUDA: inductor overlaps the tensor-parallel
    collectives with the matmuls (micro-pipelined TP over symmetric memory)."""


def parallelize(spec: ModelSpec, model: nn.Module, mesh: ParallelMesh | DeviceMesh | None,
                options: ParallelizeOptions, *, device: torch.device) -> list[FSDPUnit]:
    """Parallelize a model built on the meta device, in place; returns its FSDP units (empty
    without FSDP).

    The steps, in this order: LoRA adapts the linears → float8 converts the blocks' other
    linears → tensor parallel (a mesh with ``tp``: the family's ``spec.tensor_parallel``, by
    default our decoders' plan) → expert parallel (a mesh with ``ep``: each MoE layer's experts
    split over it) → activation checkpointing → compile → FSDP over the mesh's data-parallel
    dimensions, the experts over the expert-data ranks (or autocast on one process, without
    FSDP)."""
    if options.lora is not None:
        options.lora.apply(model)
    units = spec.fsdp_units(model)
    if options.float8 is not None:  # (before tensor parallel, which splits float8 linears its own way)
        options.float8.apply(model, blocks=units["blocks"])
    dims = mesh.names if isinstance(mesh, ParallelMesh) else ()
    if "tp" in dims:
        split = spec.tensor_parallel or apply_decoder_tensor_parallel
        split(model, mesh["tp"], loss_parallel=options.loss_parallel)
        if options.async_tensor_parallel:
            enable_async_tensor_parallel(mesh["tp"])
    experts = shard_experts(model, mesh) if "ep" in dims else None
    apply_activation_checkpointing(model, blocks=units["blocks"], mode=options.ac_mode,
                                   selective_ac_option=options.selective_ac_option, policies=options.ac_policies)
    if options.compile_model:
        compile_blocks(model, blocks=units["blocks"], backend=options.compile_backend)
    fsdp = options.fsdp
    if fsdp is None:
        if options.autocast_dtype is not None:
            apply_autocast(model, dtype=options.autocast_dtype, device_type=device.type)
        return []
    if mesh is None:
        raise ValueError("build_sharded_model: FSDP needs a mesh (or fsdp=None for a plain model)")
    shard_mesh = mesh.fsdp if isinstance(mesh, ParallelMesh) else mesh
    expert_shards = None if experts is None else ExpertShards(
        modules=experts, mesh=mesh.experts, gradient_divide_factor=float(mesh.dp_size))
    apply_fsdp(model, shard_mesh, **units, reshard_after_forward_mode=fsdp.reshard_after_forward_mode,
               param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype, cpu_offload=fsdp.cpu_offload,
               experts=expert_shards)
    return fsdp_units(model, **units)


def build_sharded_model(spec: ModelSpec, args: Any, mesh: ParallelMesh | DeviceMesh | None, *, device: torch.device,
                        seed: int, options: ParallelizeOptions | None = None, **fields: Any) -> nn.Module:
    """Build ``spec.model_cls(args)`` on the meta device, :func:`parallelize` it by ``options``
    (or by the :class:`ParallelizeOptions` ``fields`` given as keywords), allocate this rank's
    shards (each offloaded unit's on CPU, the rest on ``device``) and fill them with
    ``init_weights`` from ``seed`` (LoRA adapters too: A kaiming-uniform, B zeros). No rank ever
    holds the full model. ``mesh``: the job's :class:`ParallelMesh`, or a plain ``DeviceMesh`` to
    shard over. With ``fsdp=None`` (one process) the model stays plain, allocated whole on
    ``device`` (``mesh`` unused). The weights are the same either way: they depend on the seed only."""
    options = options if options is not None else ParallelizeOptions(**fields)
    model = spec.meta_model(args)
    units = parallelize(spec, model, mesh, options, device=device)
    materialize(model, device, units=units, cpu_offload=options.fsdp.cpu_offload if options.fsdp is not None else False)
    torch.manual_seed(seed)  # the weights depend on the seed only, not on the world size
    model.init_weights(buffer_device=device)
    return model
