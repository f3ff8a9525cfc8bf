"""Gradient clipping over sharded and plain gradients: one global norm on every rank."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, *, foreach: bool | None = None,
    pipeline_group: Any = None, counted: list[torch.nn.Parameter] | None = None,
) -> torch.Tensor:
    """Global L2 gradient norm over sharded (DTensor) or plain gradients; clip when ``max_norm > 0``.

    The norm of DTensor gradients is reduced over the mesh (``full_tensor``), so every rank
    gets the same global norm; with CPU offload that reduction runs on CPU tensors, which is
    why the process group then carries a CPU backend. ``pipeline_group``: the pipeline ranks,
    each holding other parameters (their squared norms are summed over it). ``counted``: the
    parameters whose gradients the norm counts (default all; a tied weight's second copy on
    another pipeline rank is clipped, not counted twice).
    """
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}  # DTensors of one mesh are normed and scaled together
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    counted_ids = None if counted is None else {id(p) for p in counted}
    for params in by_mesh.values():
        if counted_ids is not None:
            params = [p for p in params if id(p) in counted_ids]
            if not params:
                continue
        with _quiet_redistribute():  # (2-D: one all-reduce per mesh dimension, which DTensor warns about)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    # (Every parameter's norm once: expert-parallel experts live on a mesh of their own.)
    total = (
        norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    )
    if pipeline_group is not None:
        import torch.distributed as dist

        squared = total.double() ** 2
        dist.all_reduce(squared, group=pipeline_group)
        total = squared.sqrt().to(total.dtype)
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """Silence DTensor's advice to flatten a 2-D mesh for a reduction over both dimensions."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
