"""QLoRA: the frozen base linears of a LoRA model stored as 4-bit NormalFloat (NF4).

With ``lora.quantize_base = "nf4"`` every ``nn.Linear`` of the decoder's blocks (attention and
feed-forward; not the embedding, the norms or the output layer) keeps its weight as torchao's
``NF4Tensor``: the QLoRA paper's format, as torchtune stores it. Each block of 64 values has a
scale (its largest magnitude); the values are the nearest of 16 NormalFloat levels times it, two
4-bit codes a byte; the scales themselves are quantized to int8 in blocks of 256 around their
mean over the whole weight (double quantization), each such block with a float factor. About
0.52 bytes a value in all, against 2 in bf16.

The weight computes in the job's dtype: ``F.linear`` on an ``NF4Tensor`` (torchao's override)
dequantizes it for the product, and again in backward for the input's gradient; the adapters
(:mod:`.lora`) and their optimizer state are the usual precision.

How it is built, so that no device ever holds the whole model in full precision:

- :func:`quantize_base` swaps the weights of a model on the meta device for NF4 placeholders
  (meta, the job's dtype), before FSDP shards it. FSDP2 shards an ``NF4Tensor`` along its rows
  (torchao's split) and gathers its codes and scales (torchao's ``fsdp_pre_all_gather``): a unit
  all-gathers 4-bit weights.
- ``to_empty`` allocates each rank's codes and scales.
- Values come in through :func:`quantize_into`: the initialisation (``models/init.py``, the
  same seeded values as without quantization) and the Hugging Face import
  (``checkpoint/hf_storage.py``: each weight read into a full-precision shard of its own, one
  block's at a time) hand it each rank's rows. The scales' mean is over the whole weight (the
  ranks' block scales gathered), so each rank's codes and scales are exactly its rows of
  torchao's ``to_nf4`` of the whole weight.

Each shard must hold whole blocks of 64 × 256 values (:data:`SHARD_ALIGNMENT`):
:func:`nf4_problem` says in one line which weight does not, before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_lite.dtypes import import_torchao

__all__ = ["BLOCK_SIZE", "NF4_LEVELS", "QUANTIZE_BASE", "SCALER_BLOCK_SIZE", "SHARD_ALIGNMENT", "allocate_constants",
           "dequantized",
           "is_nf4", "nf4_bytes", "nf4_linears", "nf4_problem", "nf4_weights", "quantize_base", "quantize_into"]

QUANTIZE_BASE = ("none", "nf4")
"""``lora.quantize_base``'s values."""

BLOCK_SIZE = 64
"""Values per quantization block (each with its own scale)."""

SCALER_BLOCK_SIZE = 256
"""Block scales per second-level block (double quantization: int8 codes and one float factor)."""

SHARD_ALIGNMENT = BLOCK_SIZE * SCALER_BLOCK_SIZE
"""Values a rank's shard of a weight must be a multiple of (whole second-level blocks)."""

NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
"""The 16 NormalFloat levels (the QLoRA paper's, as torchao and bitsandbytes use them)."""


_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def _nf4_class() -> type:
    return import_torchao(_NF4_MODULE).NF4Tensor


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` (or a DTensor's local part) is an NF4 weight."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return type(tensor).__name__ == "NF4Tensor"


def nf4_bytes(numel: int) -> int:
    """Bytes of an NF4 weight of ``numel`` values: codes (half a byte each), int8 block scales,
    one fp32 factor per second-level block."""
    return numel // 2 + numel // BLOCK_SIZE + 4 * (numel // SHARD_ALIGNMENT)


def nf4_linears(model: nn.Module) -> tuple[str, ...]:
    """The linears :func:`quantize_base` stores as NF4: every ``nn.Linear`` inside the model's
    blocks (``layers.…``), in model order."""
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, nn.Linear) and name.startswith("layers."))


def nf4_problem(model: nn.Module, *, shards: int) -> str | None:
    """Why ``model``'s base cannot be stored as NF4 over ``shards`` FSDP shards, as one line, or
    None: a mixture of experts (3-D stacked weights; torchao's NF4 holds at most 2 dimensions), or
    a linear whose rows do not split evenly over the shards in whole blocks of
    :data:`SHARD_ALIGNMENT` values."""
    stacked = [name for name, p in model.named_parameters() if p.dim() > 2]
    if stacked:
        return (f"the model's mixture-of-experts weights ({stacked[0]}: {tuple(model.get_parameter(stacked[0]).shape)}"
                ") are stacked 3-D tensors, which torchao's NF4 does not store (at most 2 dimensions); expected a "
                "dense model")
    for name in nf4_linears(model):
        rows, cols = model.get_submodule(name).weight.shape
        if rows % shards or (rows // shards * cols) % SHARD_ALIGNMENT:
            return (f"{name}.weight ({rows} × {cols}) does not split over {shards} shard{'s' * (shards > 1)} into "
                    f"whole blocks of {BLOCK_SIZE} × {SCALER_BLOCK_SIZE} = {SHARD_ALIGNMENT} values (each rank's "
                    "rows must hold a multiple of them); expected a model whose linears do (the published ones "
                    "do), or fewer shards")
    return None


def _placeholder(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An NF4 weight of ``shape`` whose codes and scales are allocated but not set."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

    numel = shape[0] * shape[1]
    blocks = numel // BLOCK_SIZE
    meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, device, False)
    return _nf4_class()(meta, BLOCK_SIZE, blocks, SCALER_BLOCK_SIZE,
                        torch.empty(blocks, dtype=torch.int8, device=device),
                        torch.empty(blocks // SCALER_BLOCK_SIZE, dtype=dtype, device=device),
                        torch.empty((), dtype=dtype, device=device),
                        torch.empty(numel // 2, dtype=torch.uint8, device=device),
                        torch.tensor(NF4_LEVELS, dtype=dtype, device=device))


def quantize_base(model: nn.Module, *, dtype: torch.dtype) -> tuple[str, ...]:
    """Store the weights of :func:`nf4_linears` as NF4 (computed in ``dtype``), frozen; returns
    their names. On the meta device (before sharding) the weights become placeholders that
    initialisation or loading fills (:func:`quantize_into`); on a real device the current values
    are quantized. Raises ``ValueError`` (one line, :func:`nf4_problem`) for a model that cannot."""
    problem = nf4_problem(model, shards=1)
    if problem is not None:
        raise ValueError(f"lora.quantize_base: {problem}")
    names = []
    for name in nf4_linears(model):
        module = model.get_submodule(name)
        weight = module.weight
        if isinstance(weight, DTensor) or is_nf4(weight):
            raise ValueError(f"lora.quantize_base: {name}.weight is sharded or quantized already; quantize first")
        nf4 = _placeholder(tuple(weight.shape), dtype, weight.device)
        if weight.device.type != "meta":
            quantize_into(nf4, weight.detach())
        module.weight = nn.Parameter(nf4, requires_grad=False)
        names.append(f"{name}.weight")
    return tuple(names)


def allocate_constants(model: nn.Module) -> None:
    """After ``to_empty``: each NF4 weight's scale mean and level table where its codes are (its
    ``empty_like`` leaves these two on the meta device; :func:`quantize_into` sets their values)."""
    for _, weight in nf4_weights(model):
        local = weight._local_tensor if isinstance(weight, DTensor) else weight
        if local.scaler_mean.is_meta:
            device = local.quantized_data.device
            local.scaler_mean = torch.zeros((), dtype=local.dtype, device=device)
            local.nf4 = torch.tensor(NF4_LEVELS, dtype=local.dtype, device=device)


def nf4_weights(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The model's NF4 weights (sharded or not), by name."""
    for name, param in model.named_parameters():
        if is_nf4(param):
            yield name, param


@torch.no_grad()
def quantize_into(weight: torch.Tensor, values: torch.Tensor) -> None:
    """Set the NF4 ``weight`` (plain, or FSDP's DTensor of this rank's rows) to ``values``, the
    full-precision values of those same rows: each 64-value block's scale, codes and the
    double-quantized scales exactly as torchao's ``to_nf4`` makes them for the whole weight (the
    mean of the block scales is over every rank's rows: they are gathered, a collective over the
    weight's mesh)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax

    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    if not is_nf4(local):
        raise ValueError(f"quantize_into: expected an NF4 weight, got {type(local).__name__}")
    if tuple(values.shape) != tuple(local.shape):
        raise ValueError(f"quantize_into: values of shape {tuple(values.shape)} for rows of shape {tuple(local.shape)}")
    device, dtype = local.quantized_data.device, local.dtype
    flat = values.reshape(-1).to(device=device, dtype=dtype)
    scales = get_block_absmax(flat, BLOCK_SIZE)
    every = scales
    if isinstance(weight, DTensor) and weight.device_mesh.size() > 1:  # (every rank's rows' scales, in order)
        every = DTensor.from_local(scales, weight.device_mesh, weight.placements, run_check=False).full_tensor()
    mean = every.mean()
    centred = (scales - mean).view(-1, SCALER_BLOCK_SIZE)
    factor = 256 / (2 * get_block_absmax(centred.flatten(), SCALER_BLOCK_SIZE))
    codes = (centred * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    levels = torch.tensor(NF4_LEVELS, dtype=dtype, device=device)
    data = _nf4_class().convert_to_norm_float_weight(flat, flat.numel() // BLOCK_SIZE, BLOCK_SIZE, levels)
    local.quantized_data.copy_(data)
    local.quantized_scalers.copy_(codes)
    local.quantization_factor.copy_(factor)
    # (not gathered by FSDP: every rank's copy, set here; allocation leaves them on meta)
    local.scaler_mean = mean
    local.nf4 = levels


@torch.no_grad()
def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The full-precision values of an NF4 ``weight``: a DTensor laid out as ``weight`` when it
    is one (this rank's rows), else a plain tensor."""
    if isinstance(weight, DTensor):
        local = weight._local_tensor.get_original_weight()
        return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride())
    return weight.get_original_weight()
