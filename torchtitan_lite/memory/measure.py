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

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan_lite.gc_control import no_automatic_gc

__all__ = ["AllocatorPeak", "CATEGORIES", "by_category", "measure_step_memory", "process_memory", "profiled_peak",
           "reset_peak_rss", "trainer_step_peak"]

class AllocatorPeak:
    """The peak of live tensor bytes over a window of code, from the allocator's own figures rather
    than a tracker of ours: on CUDA ``torch.cuda.max_memory_allocated`` (reset when the window
    opens); elsewhere the CPU allocator's running total of allocated bytes, which it reports to
    ``torch.profiler`` with every allocation and free while profiling memory, counted from where
    it stood when this profiling began, over every thread (frees on gloo's worker threads
    included, see :func:`_count_every_thread`). The CPU allocator knows only what it allocated
    while counting, so open this before the tensors to count exist (the trainer and its model),
    then measure one window::

        with AllocatorPeak(device) as memory:
            trainer = Trainer(config)
            trainer.train_step()              # optimizer state made
            with memory.window():
                trainer.train_step()
        memory.peak                           # bytes
    """

    _MARK = "torchtitan_lite.allocator_peak.window"

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, 0
        self._prof: Any = None
        self._counting = False

    def __enter__(self) -> AllocatorPeak:
        if self.device.type != "cuda":
            from torch.profiler import ProfilerActivity, profile

            self._counting = _count_every_thread(True)
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """The code whose peak is :attr:`peak` (one window per instance)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        with torch.profiler.record_function(self._MARK):
            yield

    def __exit__(self, *exc: Any) -> None:
        if self._prof is None:
            return
        try:
            self._prof.__exit__(*exc)
        finally:
            _count_every_thread(self._counting)
        if exc[0] is not None:
            return
        nodes = list(self._prof.profiler.kineto_results.experimental_event_tree())
        window, allocations = None, []
        while nodes:
            node = nodes.pop()
            if node.name == self._MARK:
                window = (node.start_time_ns, node.end_time_ns)
            if str(node.tag).endswith("Allocation"):
                allocations.append(node)
            nodes.extend(node.children)
        if window is None:
            raise RuntimeError("AllocatorPeak: no window() was measured")
        if not allocations:
            return
        allocations.sort(key=lambda a: a.start_time_ns)
        # The allocator's total runs on from earlier sessions of this process: count from what it
        # stood at when this one began, and add back the blocks of earlier sessions freed during
        # this one (frees of pointers this session did not allocate).
        first = allocations[0].extra_fields
        start, earlier, mine = first.total_allocated - first.alloc_size, 0, set()
        peak = 0
        for event in allocations:
            fields = event.extra_fields
            if fields.alloc_size > 0:
                mine.add(fields.ptr)
            elif fields.ptr in mine:
                mine.discard(fields.ptr)
            else:
                earlier -= fields.alloc_size
            if window[0] <= event.start_time_ns <= window[1]:
                peak = max(peak, fields.total_allocated - start + earlier)
        self.peak = peak


def _count_every_thread(on: bool) -> bool:
    """Make the CPU allocator keep its running total over every thread (c10's
    ``caffe2_report_cpu_memory_usage`` flag); return the flag's previous value.

    While profiling memory, the allocator counts and reports only the threads the profiler
    follows: a tensor allocated on this thread and freed on another (gloo's worker threads free
    the buffers of collectives they ran) would stay in the total for good. With the flag on, the
    total drops when such a tensor is freed, and the next event reported here carries the true
    figure. Raises ``RuntimeError`` where the flag is not found (a torch without it)."""
    import ctypes

    library = Path(torch.__file__).parent / "lib" / ("libc10.dylib" if sys.platform == "darwin" else "libc10.so")
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"AllocatorPeak: cannot switch on the CPU allocator's count over every thread "
                           f"({library}: {exc})") from None
    previous = bool(flag.value)
    flag.value = on
    return previous


def profiled_peak(fn: Callable[[], Any], *, device: torch.device) -> int:
    """:class:`AllocatorPeak` of ``fn()`` alone (on CPU only the tensors made during it count)."""
    with AllocatorPeak(device) as memory, memory.window():
        fn()
    return memory.peak


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


def trainer_step_peak(make_trainer: Callable[[], Any], *, warmup: int = 1) -> tuple[int, Any]:
    """:class:`AllocatorPeak` of one steady-state ``train_step`` of the trainer ``make_trainer()``
    builds (e.g. ``functools.partial(Trainer, config)``): the trainer is built inside the
    measurement, takes ``warmup`` steps (its optimizer state then exists; online RL with
    ``grpo.num_iterations`` = μ: μ of them, so that the measured step generates) and the measured
    one. Returns the peak in bytes and the trainer (its process group still up). For the tests
    and benchmarks that hold the memory estimate against it."""
    from torchtitan_lite.distributed import choose_device, world_info_from_env

    with AllocatorPeak(choose_device(world_info_from_env()[1])) as memory:
        trainer = make_trainer()
        for _ in range(warmup):
            trainer.train_step()
        with memory.window():
            trainer.train_step()
    return memory.peak, trainer
