"""The meta-init path of a registered model: build on the meta device, add LoRA adapters,
convert to float8, checkpoint activations, compile, shard, allocate, initialise.

The order matters and is the one TorchTitan uses: LoRA adapts its linears first (the adapters
are then parameters of their blocks like any other: checkpointed, compiled and sharded with
them), the float8 conversion swaps the blocks' other linears next (so that all that follows wraps the converted layers), activation checkpointing wraps each block's
forward first (so that compile traces the checkpoint as part of the block's graph), compile
comes next, and ``fully_shard`` last (so that its hooks, which gather and free parameters, stay
outside the compiled code).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.distributed.activation_checkpoint import BlockPolicy, apply_activation_checkpointing
from torchtitan_lite.distributed.autocast import apply_autocast
from torchtitan_lite.distributed.compile import compile_blocks
from torchtitan_lite.distributed.float8 import Float8Plan
from torchtitan_lite.distributed.fsdp import FSDPOptions, apply_fsdp, fsdp_units, materialize
from torchtitan_lite.distributed.lora import LoRAPlan
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["build_sharded_model"]


def build_sharded_model(
    spec: ModelSpec,
    args: Any,
    mesh: DeviceMesh | None,
    *,
    device: torch.device,
    seed: int,
    ac_mode: str = "none",
    selective_ac_option: str | int = "op",
    ac_policies: Sequence[BlockPolicy] | None = None,
    compile_model: bool = False,
    compile_backend: str = "inductor",
    float8: Float8Plan | None = None,
    fsdp: FSDPOptions | None = FSDPOptions(),  # noqa: B008 - frozen
    autocast_dtype: torch.dtype | None = None,
    lora: LoRAPlan | None = None,
) -> nn.Module:
    """Build ``spec.model_cls(args)`` on the meta device; adapt the linears ``lora`` names with
    low-rank adapters and freeze the rest (:mod:`.lora`); convert its blocks' other linears to float8
    by ``float8``; checkpoint its blocks by ``ac_mode`` and ``selective_ac_option`` (TorchTitan's
    settings) or by ``ac_policies`` (one of ``none``/``full``/``op`` per block; see
    :func:`~.activation_checkpoint.block_policies`); compile its blocks when ``compile_model``
    (with ``compile_backend``); shard it with :func:`~.fsdp.apply_fsdp` over the spec's units and
    ``mesh`` by ``fsdp``; allocate this rank's shards (each offloaded unit's on CPU, see
    ``fsdp.cpu_offload``, the rest on ``device``) and fill them with ``init_weights`` from ``seed`` (the adapters too: A
    kaiming-uniform, B zeros). No rank ever holds the full model.

    ``fsdp=None`` (one process) keeps the model plain, allocated whole on ``device`` (``mesh``
    unused), with its forward under autocast in ``autocast_dtype`` when given (see
    :mod:`.autocast`). The weights are the same either way: they depend on the seed only."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    if lora is not None:
        lora.apply(model)
    units = spec.fsdp_units(model)
    if float8 is not None:
        float8.apply(model, blocks=units["blocks"])
    apply_activation_checkpointing(model, blocks=units["blocks"], mode=ac_mode,
                                   selective_ac_option=selective_ac_option, policies=ac_policies)
    if compile_model:
        compile_blocks(model, blocks=units["blocks"], backend=compile_backend)
    if fsdp is not None:
        if mesh is None:
            raise ValueError("build_sharded_model: FSDP needs a mesh (or fsdp=None for a plain model)")
        apply_fsdp(model, mesh, **units, reshard_after_forward_mode=fsdp.reshard_after_forward_mode,
                   param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype, cpu_offload=fsdp.cpu_offload)
    elif autocast_dtype is not None:
        apply_autocast(model, dtype=autocast_dtype, device_type=device.type)
    sharded_units = fsdp_units(model, **units) if fsdp is not None else []
    materialize(model, device, units=sharded_units, cpu_offload=fsdp.cpu_offload if fsdp is not None else False)
    torch.manual_seed(seed)  # the weights depend on the seed only, not on the world size
    model.init_weights(buffer_device=device)  # type: ignore[operator]
    return model
