"""Measured memory of a training step, per rank and by category.

:func:`measure_step_memory` runs real training steps under PyTorch's ``FSDPMemTracker`` (a
``TorchDispatchMode`` that attributes every live tensor to a category) and reports, in bytes:

- ``peak``: each category at the moment the total peaked, and that total;
- ``state``: the persistent training state once a step has finished (sharded parameters,
  sharded gradients just before the optimizer step, optimizer state after it).

It works on CPU and GPU tensors alike, so the figures on a CPU machine are the tensor bytes a
GPU would hold (allocator caching and fragmentation are not included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan_lite.gc_control import no_automatic_gc

__all__ = ["CATEGORIES", "by_category", "measure_step_memory", "process_memory", "reset_peak_rss"]

# Our names for FSDPMemTracker's categories (its _FSDPRefType values).
CATEGORIES = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather_buffers",
    "Reduce Scatter": "reduce_scatter_buffers",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}


def by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """Sum a tracker snapshot over devices, keyed by our category names plus ``total``."""
    out = dict.fromkeys([*CATEGORIES.values(), "total"], 0)
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = "total" if key == "Total" else CATEGORIES.get(getattr(key, "value", str(key)))
            if name is not None:
                out[name] += int(value)
    return out


def measure_step_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    *,
    steps: int = 2,
) -> dict[str, dict[str, int]]:
    """Run ``steps`` training steps (``loss_fn()`` → backward → optimizer step → zero_grad)
    under ``FSDPMemTracker``; return ``{"peak": {...}, "state": {...}}`` in bytes per category,
    and ``peak_by_device`` (each device's total at its peak: with CPU offload on a GPU, the
    offloaded state is counted under ``cpu``).

    The peak is over all steps; from the second step on it includes the optimizer state (the
    first step creates it only at its end), so ``steps >= 2`` gives a steady-state peak.
    Automatic garbage collection is off meanwhile (:func:`no_automatic_gc`), as in the trainer.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    state: dict[str, int] = {}
    with no_automatic_gc(), tracker:
        for _ in range(steps):
            loss_fn().backward()
            grads = by_category(tracker.get_tracker_snapshot("current"))["sharded_grads"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            current = by_category(tracker.get_tracker_snapshot("current"))
            state = {"sharded_params": current["sharded_params"], "sharded_grads": grads,
                     "optimizer_state": current["optimizer_state"]}
    peak = tracker.get_tracker_snapshot("peak")
    return {"peak": by_category(peak), "state": state,
            "peak_by_device": {str(dev): int(snap.get("Total", 0)) for dev, snap in peak.items()}}


def process_memory() -> dict[str, int]:
    """This process's resident memory now (``rss``) and at its peak (``peak_rss``), in bytes,
    from Linux's ``/proc/self/status``."""
    names = {"VmRSS": "rss", "VmHWM": "peak_rss"}
    values = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in names:
                values[names[key]] = int(rest.split()[0]) * 1024
    return values


def reset_peak_rss() -> None:
    """Make the peak resident memory (``peak_rss``) restart from the current one (Linux)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
