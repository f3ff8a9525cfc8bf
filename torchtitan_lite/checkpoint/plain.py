"""Model and optimizer state as plain tensors, for checkpoints that any job can read.

torchao's float8 all-gather (``float8.enable_fsdp_float8_all_gather``) keeps each block weight in
a tensor subclass (``WeightWithDynamicFloat8CastTensor``), and optimizer moments made with
``zeros_like`` inherit it. Saved as they are, a DCP checkpoint records that class (a job without
float8 cannot load it with ``weights_only``), and the safetensors writer fails (the wrapper has
no storage of its own). :func:`plain_tensor` gives the wrapped tensor itself, sharing storage,
so reads and writes through it reach the weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["plain_state", "plain_tensor"]


def plain_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param`` (or a DTensor's local tensor) without a tensor subclass that wraps it, sharing
    its storage; a tensor that wraps nothing (or more than one tensor of its shape) as it is."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    inner = local
    while is_traceable_wrapper_subclass(inner):
        attrs, _ = inner.__tensor_flatten__()
        # The weight itself: the one inner tensor of the wrapper's shape and dtype (a float8
        # wrapper may also hold a precomputed scale).
        same = [t for t in (getattr(inner, a) for a in attrs) if t.shape == inner.shape and t.dtype == inner.dtype]
        if len(same) != 1:
            break  # not a wrapper of one weight: leave it as it is
        inner = same[0]
    if inner is local:
        return param
    if isinstance(param, DTensor):
        return DTensor.from_local(inner, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return inner


def plain_state(state: Any) -> Any:
    """``state`` (nested dicts and lists, as ``get_state_dict`` gives) with every tensor plain."""
    if isinstance(state, torch.Tensor):
        return plain_tensor(state)
    if isinstance(state, dict):
        return {key: plain_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [plain_state(value) for value in state]
    return state
