"""Mixed precision without FSDP: the model's forward under ``torch.autocast``.

A job of one process trains the plain model (no ``fully_shard``, whose unsharded copies and flat
gradient buffers buy nothing on one rank). Its parameters, gradients and optimizer state stay in
fp32, and :func:`apply_autocast` runs the forward under ``torch.autocast`` in the compute dtype:
matmuls and attention in bf16, reductions, norms and softmax where autocast keeps them in fp32,
each weight cast once per forward (autocast caches the cast of a leaf parameter within its
region), gradients accumulated in fp32 directly. TorchTitan trains a model without FSDP the same
way. FSDP's ``MixedPrecisionPolicy`` instead casts every parameter to bf16 and computes every op in
it, so the two differ by bf16 rounding, not in what they train.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["apply_autocast", "autocast_dtype"]


@functools.cache
def _autocast_class(cls: type[nn.Module], dtype: torch.dtype, device_type: str) -> type[nn.Module]:
    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        with torch.autocast(device_type, dtype=dtype):
            return cls.forward(self, *args, **kwargs)

    return type(f"Autocast{cls.__name__}", (cls,), {
        "forward": forward,
        "__module__": cls.__module__,
        "_autocast": (dtype, device_type),
    })


def apply_autocast(model: nn.Module, *, dtype: torch.dtype, device_type: str) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(device_type, dtype)`` from now on, in place
    (its class becomes a subclass with that forward: parameter names and ``state_dict`` keys are
    unchanged); returns ``model``."""
    model.__class__ = _autocast_class(type(model), dtype, device_type)
    return model


def autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`apply_autocast` gave ``model``, or None."""
    setting = getattr(type(model), "_autocast", None)
    return None if setting is None else setting[0]
