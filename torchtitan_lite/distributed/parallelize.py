"""The meta-init path of a registered model: build on the meta device, parallelize (the family's
steps), allocate, initialise. :func:`build_sharded_model` is the one way a model is built, for
the trainer, the memory estimator and ``auto`` alike.

:func:`parallelize` runs the family's ``ModelSpec.parallelize`` (a family adds its own steps,
e.g. tensor parallel on ``mesh["tp"]``, and calls :func:`default_parallelize` for the rest), or
:func:`default_parallelize`, whose order is TorchTitan's: LoRA adapts the linears first (the
adapters are then parameters of their blocks like any other: checkpointed, compiled and sharded
with them), the float8 conversion swaps the blocks' other linears next (so that all that follows
wraps the converted layers: tensor parallel splits them with torchao's float8 styles), tensor and
expert parallel split the layers, activation checkpointing wraps each block's forward (so that compile
traces the checkpoint as part of the block's graph), compile comes next, and ``fully_shard`` last
(so that its hooks, which gather and free parameters, stay outside the compiled code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.distributed.activation_checkpoint import BlockPolicy, apply_activation_checkpointing
from torchtitan_lite.distributed.autocast import apply_autocast
from torchtitan_lite.distributed.compile import compile_blocks
from torchtitan_lite.distributed.float8 import Float8Conversion
from torchtitan_lite.distributed.fsdp import FSDPOptions, FSDPUnit, apply_fsdp, fsdp_units, materialize
from torchtitan_lite.distributed.lora import LoRASetup
from torchtitan_lite.distributed.mesh import ParallelMesh
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["ParallelizeOptions", "build_sharded_model", "default_parallelize", "parallelize"]


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
    fsdp: FSDPOptions | None = FSDPOptions()  # noqa: RUF009 - frozen
    """How to shard; None: one process, the model kept plain (allocated whole)."""
    autocast_dtype: torch.dtype | None = None
    """Without FSDP: run the forward under autocast in this dtype (bf16 on one process)."""
    lora: LoRASetup | None = None
    loss_parallel: bool = True
    """Under tensor parallel: the logits stay split over the vocabulary for the loss."""
    async_tensor_parallel: bool = False
    """Under tensor parallel with compiled blocks on CUDA: inductor overlaps the tensor-parallel
    collectives with the matmuls (micro-pipelined TP over symmetric memory)."""


def default_parallelize(spec: ModelSpec, model: nn.Module, mesh: ParallelMesh | DeviceMesh | None,
                        options: ParallelizeOptions, *, device: torch.device,
                        tensor_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None) -> list[FSDPUnit]:
    """LoRA → float8 → tensor parallel (a mesh with ``tp``) → expert parallel (a mesh with
    ``ep``: each MoE layer's experts split over it, see
    :func:`~torchtitan_lite.distributed.expert_parallel.shard_experts`) → activation
    checkpointing → compile → FSDP over the mesh's data-parallel dimensions (or autocast on one
    process); returns the FSDP units (empty without FSDP).
    ``tensor_parallel``: a family's split of its model over ``mesh["tp"]`` (a mesh with ``tp``),
    run after LoRA and float8."""
    if options.lora is not None:
        options.lora.apply(model)
    units = spec.fsdp_units(model)
    if options.float8 is not None:  # (before tensor parallel, which splits float8 linears its own way)
        options.float8.apply(model, blocks=units["blocks"])
    if isinstance(mesh, ParallelMesh) and "tp" in mesh.names:
        if tensor_parallel is None:
            raise ValueError(f"model family {spec.name!r} has no tensor-parallel plan")
        tensor_parallel(model, mesh["tp"])
    if isinstance(mesh, ParallelMesh) and "ep" in mesh.names:  # a mixture of experts' experts over mesh["ep"]
        from torchtitan_lite.distributed.expert_parallel import shard_experts

        experts_step = shard_experts(model, mesh)
    else:
        experts_step = None
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
    listed = fsdp_units(model, **units)
    if experts_step is not None:  # the experts follow their blocks' reshard and offload settings
        experts_step(fsdp, listed)
    apply_fsdp(model, shard_mesh, **units, reshard_after_forward_mode=fsdp.reshard_after_forward_mode,
               param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype, cpu_offload=fsdp.cpu_offload)
    return listed


def parallelize(spec: ModelSpec, model: nn.Module, mesh: ParallelMesh | DeviceMesh | None,
                options: ParallelizeOptions, *, device: torch.device) -> list[FSDPUnit]:
    """The family's parallelize steps on a model built on the meta device (``spec.parallelize``,
    else :func:`default_parallelize`); returns the FSDP units."""
    steps = spec.parallelize or default_parallelize
    if isinstance(steps, str):  # "module:function"
        import importlib

        module, _, function = steps.partition(":")
        steps = getattr(importlib.import_module(module), function)
    return list(steps(spec, model, mesh, options, device=device))


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
    model.init_weights(buffer_device=device)  # type: ignore[operator]
    return model
