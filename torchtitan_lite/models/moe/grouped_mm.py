"""Grouped matrix products: each expert's rows times its weight, in one call.

``torch._grouped_mm`` runs them where it runs (probed once per device type and dtype by
:func:`grouped_mm_available`); elsewhere, and compiled where it takes bf16 only, one custom
operator (``torchtitan_lite::grouped_mm``, opaque to torch.compile) loops over the groups, with
its own backward. On the memory estimator's fake tensors the operator also holds the copies
``torch._grouped_mm``'s CPU kernel makes, so that the estimate counts them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["grouped_mm", "grouped_mm_available"]

_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}
"""Whether ``torch._grouped_mm`` runs, per (device type, dtype): probed once, eagerly."""


def grouped_mm_available(device_type: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and dtype
    (torch >= 2.9 on CPU; CUDA with its own rules). Probed on first use, outside autograd and any
    dispatch mode (the first call may come inside a checkpointed forward, whose saved tensors must
    not change); under ``torch.compile`` only the probed answer is read (the decoder probes its
    device when it builds its buffers), unprobed is no."""
    key = (device_type, dtype)
    if key in _GROUPED_MM or torch.compiler.is_compiling():
        return _GROUPED_MM.get(key, False)
    from torch.utils._python_dispatch import _disable_current_modes

    available = hasattr(torch, "_grouped_mm")
    if available:
        try:  # the forward and the two products of its backward
            with torch.no_grad(), _disable_current_modes():
                x = torch.ones(8, 16, device=device_type, dtype=dtype)  # (no random draw: the RNG is the init's)
                w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
                offs = torch.tensor([3, 8], dtype=torch.int32, device=device_type)
                out = torch._grouped_mm(x, w, offs=offs)
                torch._grouped_mm(out, w.transpose(-2, -1), offs=offs)  # the input's gradient
                torch._grouped_mm(x.t(), out, offs=offs)  # the weights' gradient
        except (RuntimeError, NotImplementedError):
            available = False
    _GROUPED_MM[key] = available
    return available


def _looped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` ``(rows, k)`` in groups ending at ``offs``, group ``g`` times ``b[g]`` ``(k, n)``."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        torch.mm(a[start:end], b[group], out=out[start:end])
        start = end
    return out


@torch.library.custom_op("torchtitan_lite::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped products as one operator torch.compile does not look into: what the experts run
    where ``torch._grouped_mm`` cannot be compiled (its compiled form takes bf16 only) or does
    not run."""
    if grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a, b, offs=offs)
    return _looped_mm(a, b, offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("torchtitan_lite::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """``out[g] = a_gᵀ · grad_g`` ``(groups, k, n)``: the gradient of :func:`_grouped_mm_op`'s ``b``."""
    if grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a.t(), grad, offs=offs)
    out = a.new_zeros(groups, a.shape[1], grad.shape[1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        torch.mm(a[start:end].t(), grad[start:end], out=out[group])
        start = end
    return out


@_grouped_mm_weight_grad.register_fake
def _(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    return a.new_empty(groups, a.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    with _cpu_kernel_copies(grad, b):
        grad_a = _grouped_mm_op(grad, b.transpose(-2, -1), offs)
    with _cpu_kernel_copies(a, grad):
        grad_b = _grouped_mm_weight_grad(a, grad, offs, b.shape[0])
    return grad_a, grad_b, None


@contextlib.contextmanager
def _cpu_kernel_copies(*operands: torch.Tensor) -> Iterator[None]:
    """On the memory estimator's fake tensors, the copies of both operands that
    ``torch._grouped_mm``'s CPU kernel makes, alive while the product runs (measured: its extra
    bytes are the operands' own); nothing on real tensors."""
    from torch._subclasses.fake_tensor import is_fake

    estimating = not torch.compiler.is_compiling() and is_fake(operands[0])
    copies = [t.clone() for t in operands] if estimating else []
    yield
    del copies


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` where it runs (eagerly, or compiled or on fake
    tensors in bf16), else the same products as one custom operator (compiled: opaque to
    torch.compile; eagerly: a loop over the groups where ``torch._grouped_mm`` does not run), with
    its own backward."""
    from torch._subclasses.fake_tensor import is_fake

    # (Compiled, torch._grouped_mm takes bf16 only; on the memory estimator's fake tensors the
    # operator, whose backward shows the CPU kernel's copies, stands for it.)
    if torch.compiler.is_compiling():
        if a.dtype == torch.bfloat16 and grouped_mm_available(a.device.type, a.dtype):
            return torch._grouped_mm(a, b, offs=offs)
        return _grouped_mm_op(a, b, offs)
    if not is_fake(a) and grouped_mm_available(a.device.type, a.dtype):
        return torch._grouped_mm(a, b, offs=offs)
    with _cpu_kernel_copies(a, b):
        return _grouped_mm_op(a, b, offs)
