"""Seeded, shard-aware weight initialisation.

The values a parameter receives depend only on the global RNG state when its initialiser is
called, never on how the parameter is sharded: each parameter is filled block by block along
dim 0 (blocks of a fixed size), every block from its own generator seeded from one draw of the
global generator. A rank that holds rows ``[a, b)`` of a sharded parameter generates only the
blocks overlapping those rows (and keeps its part of each row when the parameter is sharded along
a later dimension), so the full parameter is never materialised and the result is
the same on 1, 2 or 4 ranks, and on CPU or GPU (values are always drawn on the CPU and copied).

This module knows about ``DTensor`` (to find which rows a rank holds) but nothing of FSDP. A
QLoRA weight (NF4, :mod:`torchtitan_lite.models.nf4`) gets the same values, drawn in full
precision and quantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from torchtitan_lite.models.nf4 import is_nf4, quantize_into

__all__ = ["normal_", "trunc_normal_", "uniform_", "ones_", "zeros_"]

# Elements generated per block; fixed so that values do not depend on sharding.
_BLOCK_ELEMENTS = 1 << 18
_SEED_MODULUS = 1 << 62


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor and the global offset of its first element in every dimension."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(int(o) for o in offset)
    return tensor, (0,) * tensor.dim()


@torch.no_grad()
def _fill_blockwise(
    tensor: torch.Tensor, fill: Callable[[torch.Tensor, torch.Generator], None]
) -> torch.Tensor:
    local, offset = _local_part(tensor)
    # One draw from the global generator per parameter: identical on every rank.
    base_seed = int(torch.randint(0, _SEED_MODULUS, (1,), dtype=torch.int64).item())
    if local.numel() == 0 or local.is_meta:  # (meta: a part of the model another pipeline rank holds)
        return tensor
    quantized = is_nf4(local)
    if quantized:  # (QLoRA's 4-bit weight: the same values, drawn into full precision, then quantized)
        local = torch.empty(local.shape, dtype=torch.float32)
    full_shape = tuple(tensor.shape)
    if not full_shape:  # a scalar is one row of one element (never sharded)
        local, full_shape, offset = local.view(1), (1,), (0,)
    row_offset = offset[0]
    # A shard along a later dimension (a stacked weight with fewer experts than ranks) keeps
    # its part of each generated row.
    within = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    row_numel = math.prod(full_shape[1:]) or 1
    rows_per_block = max(1, _BLOCK_ELEMENTS // row_numel)
    n_local = local.shape[0]
    first_block = row_offset // rows_per_block
    last_block = (row_offset + n_local - 1) // rows_per_block
    for block in range(first_block, last_block + 1):
        block_start = block * rows_per_block
        block_rows = min(rows_per_block, full_shape[0] - block_start)
        # Always a CPU generator: CPU (mt19937) and CUDA (Philox) streams differ, and the
        # weights must not depend on where the parameters live (GPU, CPU offload or CPU).
        generator = torch.Generator().manual_seed(
            (base_seed + 1_000_003 * (block + 1)) % _SEED_MODULUS
        )
        values = torch.empty((block_rows, *full_shape[1:]), dtype=torch.float32)
        fill(values, generator)
        lo = max(row_offset, block_start)
        hi = min(row_offset + n_local, block_start + block_rows)
        local[lo - row_offset : hi - row_offset].copy_(values[(slice(lo - block_start, hi - block_start), *within)])
    if quantized:
        quantize_into(tensor, local)
    return tensor


def normal_(tensor: torch.Tensor, *, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Fill ``tensor`` (plain or sharded) from N(mean, std²), independent of sharding."""
    return _fill_blockwise(
        tensor, lambda t, g: torch.nn.init.normal_(t, mean=mean, std=std, generator=g)
    )


def trunc_normal_(
    tensor: torch.Tensor,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    a: float | None = None,
    b: float | None = None,
) -> torch.Tensor:
    """Truncated normal on ``[a, b]`` (default ±2 std around the mean), independent of sharding."""
    lo = mean - 2 * std if a is None else a
    hi = mean + 2 * std if b is None else b
    return _fill_blockwise(
        tensor,
        lambda t, g: torch.nn.init.trunc_normal_(t, mean=mean, std=std, a=lo, b=hi, generator=g),
    )


def uniform_(tensor: torch.Tensor, *, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """Fill ``tensor`` (plain or sharded) from U(a, b), independent of sharding."""
    return _fill_blockwise(tensor, lambda t, g: torch.nn.init.uniform_(t, a=a, b=b, generator=g))


@torch.no_grad()
def ones_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with ones (plain or sharded)."""
    local, _ = _local_part(tensor)
    local.fill_(1.0)
    return tensor


@torch.no_grad()
def zeros_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with zeros (plain or sharded)."""
    local, _ = _local_part(tensor)
    local.zero_()
    return tensor
