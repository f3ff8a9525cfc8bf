"""The meta-init path of a registered model: build on the meta device, parallelize, allocate,
initialise. :func:`build_sharded_model` is the one way a model is built, for the trainer, the
memory estimator and ``auto`` alike.

:func:`parallelize` is the one path, in TorchTitan's order (:data:`BUILD_STEPS`): the pipeline
split first (each rank keeps its stages' layers), LoRA adapts the linears next (the adapters are
then parameters of their blocks like any other: checkpointed, compiled and sharded with them), the
float8 conversion swaps the blocks' other linears (so that all that follows wraps the converted
layers: tensor parallel splits them with torchao's float8 styles), tensor parallel splits the
layers, context parallel gives the model its share of each sequence (:mod:`.context_parallel`),
expert parallel splits the experts, activation checkpointing wraps each block's forward (so that
compile traces the checkpoint as part of the block's graph), compile comes next, and
``fully_shard`` last (so that its hooks, which gather and free parameters, stay outside the
compiled code).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtitan_lite.distributed.activation_offload import ActivationOffload
from torchtitan_lite.distributed.autocast import apply_autocast
from torchtitan_lite.distributed.compile import compile_blocks
from torchtitan_lite.distributed.context_parallel import ContextParallel
from torchtitan_lite.distributed.expert_parallel import shard_experts
from torchtitan_lite.distributed.fsdp import (
    ExpertShards,
    FSDPUnit,
    apply_fsdp,
    fsdp_units,
    materialize,
)
from torchtitan_lite.distributed.job_shape import JobShape
from torchtitan_lite.distributed.mesh import ParallelMesh
from torchtitan_lite.distributed.pipeline_parallel import init_stage_weights, prune_to_stages
from torchtitan_lite.distributed.tensor_parallel import (
    apply_decoder_tensor_parallel,
    enable_async_tensor_parallel,
)
from torchtitan_lite.loss import tile_output
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["BUILD_STEPS", "JobShape", "Parallelized", "build_parallelized", "build_sharded_model", "parallelize"]

BUILD_STEPS = ("pipeline split", "LoRA", "float8", "tensor parallel", "context parallel", "expert parallel",
               "activation checkpointing", "compile", "FSDP2")
"""The steps of :func:`parallelize`, in the order it takes them (``tests/test_docs.py`` holds the
function's calls and the pages' diagrams to this order)."""


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` built around a model, for those who run it (the trainer's
    :class:`~torchtitan_lite.training.runner.MicroBatchRunner`, the memory estimator)."""

    model: nn.Module
    """The model, parallelized in place."""
    units: list[FSDPUnit] = field(default_factory=list)
    """Its FSDP units in forward order, root excluded (empty without FSDP)."""
    context_parallel: ContextParallel | None = None
    """With context parallel: how a rank takes its share of each sequence (``shard_batch``)."""
    activation_offload: ActivationOffload | None = None
    """With ``activation_checkpoint.offload``: what keeps the checkpointed blocks' inputs in host
    memory (its byte counts)."""


def parallelize(spec: ModelSpec, model: nn.Module, mesh: ParallelMesh | DeviceMesh | None,
                shape: JobShape, *, device: torch.device) -> Parallelized:
    """Parallelize a model built on the meta device, in place; returns what it built around it
    (:class:`Parallelized`: its FSDP units, its context-parallel share).

    The steps, in the order of :data:`BUILD_STEPS`: the pipeline split (``shape.pipeline``: the
    model cut to this rank's stages) → LoRA adapts the linears → float8 converts the blocks' other
    linears → tensor parallel (a mesh with ``tp``: the family's ``spec.tensor_parallel``, by
    default our decoders' plan) → context parallel (a mesh with ``cp``: the model's share of each
    sequence) → expert parallel (a mesh with ``ep``: each MoE layer's experts split over it) →
    activation checkpointing → compile → FSDP over the mesh's data-parallel dimensions, the
    experts over the expert-data ranks (or autocast on one process, without FSDP). ``shape``: the
    job's (:class:`~torchtitan_lite.distributed.job_shape.JobShape`), of which this reads LoRA,
    float8, loss parallel, checkpointing, compile and how FSDP shards."""
    if shape.pipeline is not None:
        if not isinstance(mesh, ParallelMesh):
            raise ValueError("parallelize: pipeline parallel needs the job's ParallelMesh (its pp dimension)")
        prune_to_stages(model, shape.pipeline, mesh.pp_rank)
    if shape.lora is not None:
        lora = shape.lora
        if shape.pipeline is not None:  # the linears of this rank's stages
            present = dict(model.named_modules())
            lora = dataclasses.replace(lora, linears=tuple(n for n in lora.linears if n in present),
                                       experts=tuple(n for n in lora.experts if n in present))
        lora.apply(model)
    units = spec.fsdp_units(model)
    if shape.float8 is not None:  # (before tensor parallel, which splits float8 linears its own way)
        shape.float8.apply(model, blocks=units["blocks"])
    dims = mesh.split_dims if isinstance(mesh, ParallelMesh) else ()
    if "tp" in dims:
        split = spec.tensor_parallel or apply_decoder_tensor_parallel
        split(model, mesh["tp"], loss_parallel=shape.loss_parallel)
        if shape.async_tensor_parallel:
            enable_async_tensor_parallel(mesh["tp"])
    context_parallel = None
    if "cp" in dims:
        if not hasattr(model, "use_context_parallel"):
            raise ValueError(f"context parallel: {type(model).__name__} does not take a share of each sequence "
                             "(no use_context_parallel method); expected a Decoder")
        context_parallel = ContextParallel(mesh["cp"].get_group(), method=shape.context_parallel_method)
        model.use_context_parallel(context_parallel)
    experts = shard_experts(model, mesh) if "ep" in dims else None
    if shape.tiled_loss:
        tile_output(model)
    offload = ActivationOffload() if shape.activation_offload else None
    apply_activation_checkpointing(model, blocks=units["blocks"], mode=shape.ac_mode,
                                   selective_ac_option=shape.selective_ac_option, policies=shape.ac_policies,
                                   offload=offload, mlp_tiles=shape.mlp_tiles)
    if shape.compile_model:
        if shape.pipeline is not None and shape.pipeline.splits_backward:
            # A zero-bubble schedule runs each compiled backward twice (input, then weight pass,
            # on a retained graph), which donated buffers would have freed after the first.
            torch._functorch.config.donated_buffer = False
        compile_blocks(model, blocks=units["blocks"], backend=shape.compile_backend, by_parts=shape.compile_by_parts)
    fsdp = shape.fsdp_options()
    if fsdp is None:
        if shape.autocast_dtype is not None:
            apply_autocast(model, dtype=shape.autocast_dtype, device_type=device.type)
        return Parallelized(model, [], context_parallel, offload)
    if mesh is None:
        raise ValueError("build_sharded_model: FSDP needs a mesh (or fsdp=None for a plain model)")
    shard_mesh = mesh.fsdp if isinstance(mesh, ParallelMesh) else mesh
    expert_shards = None if experts is None else ExpertShards(
        modules=experts, mesh=mesh.experts, gradient_divide_factor=float(mesh.dp_size * mesh.dims.cp))
    apply_fsdp(model, shard_mesh, **units, reshard_after_forward_mode=fsdp.reshard_after_forward_mode,
               param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype, cpu_offload=fsdp.cpu_offload,
               experts=expert_shards)
    return Parallelized(model, fsdp_units(model, **units), context_parallel, offload)


def build_sharded_model(spec: ModelSpec, args: Any, mesh: ParallelMesh | DeviceMesh | None, *, device: torch.device,
                        seed: int, shape: JobShape | None = None, **fields: Any) -> nn.Module:
    """The model of :func:`build_parallelized` (same arguments), without what was built around it."""
    return build_parallelized(spec, args, mesh, device=device, seed=seed, shape=shape, **fields).model


def build_parallelized(spec: ModelSpec, args: Any, mesh: ParallelMesh | DeviceMesh | None, *, device: torch.device,
                       seed: int, shape: JobShape | None = None, **fields: Any) -> Parallelized:
    """Build ``spec.model_cls(args)`` on the meta device, :func:`parallelize` it as ``shape``
    says (with ``fields``, any :class:`~torchtitan_lite.distributed.job_shape.JobShape` field, in
    place of its own), allocate this rank's shards (each offloaded unit's on CPU, the rest on
    ``device``) and fill them with ``init_weights`` from ``seed`` (LoRA adapters too: A
    kaiming-uniform, B zeros). No rank ever holds the full model. ``mesh``: the job's
    :class:`ParallelMesh`, or a plain ``DeviceMesh`` to shard over. With ``sharded=False`` (one
    process) the model stays plain, allocated whole on ``device`` (``mesh`` unused). The weights
    are the same either way: they depend on the seed only."""
    shape = (shape or JobShape()).replace(**fields)
    model = spec.meta_model(args)
    built = parallelize(spec, model, mesh, shape, device=device)
    fsdp = shape.fsdp_options()
    materialize(model, device, units=built.units, cpu_offload=fsdp.cpu_offload if fsdp is not None else False)
    torch.manual_seed(seed)  # the weights depend on the seed only, not on the world size
    if shape.pipeline is not None:  # the whole model's values for this rank's stages
        whole = spec.meta_model(args)
        if shape.lora is not None:  # (its adapters draw too, after every base weight)
            shape.lora.apply(whole)
        init_stage_weights(model, whole, buffer_device=device)
    else:
        model.init_weights(buffer_device=device)
    return built
