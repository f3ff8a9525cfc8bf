"""A training step on fake tensors, as the memory estimate runs it: a fake process group of any
size (:func:`fake_world`), FSDP's memory tracker with what it leaves out counted (CPU-offloaded
state, optimizer state made lazily), the optimizer's twin that allocates its state before the step,
and FSDP's all-gather as gloo runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_lite.distributed.fsdp import (
    AllGatherComm,
    set_custom_all_gather,
)
from torchtitan_lite.memory.measure import by_category

__all__ = ["EIGHT_BIT_BLOCK", "EightBitTwin", "GlooAllGather", "LocalOptimizer", "OffloadedBytes", "as_sharded_params",
           "fake_world", "gloo_all_gathers", "local_part", "make_tracker", "nbytes"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks (this process is ``rank``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class OffloadedBytes:
    """The bytes of the offloaded units' state at any moment of the step: their sharded
    parameters and optimizer state (there all along) and their sharded gradients (from their
    reduce-scatter to ``zero_grad``), read from the tensors themselves."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: LocalOptimizer) -> None:
        self.params = params
        locals_ = {id(param): local for param, local in optimizer.pairs}
        state = optimizer.optimizer.state
        self.static = sum(nbytes(local_part(p)) for p in params) + sum(
            nbytes(value) for p in params if id(p) in locals_
            for value in state.get(locals_[id(p)], {}).values() if isinstance(value, torch.Tensor))

    def now(self) -> int:
        """Bytes on CPU now."""
        return self.static + sum(nbytes(local_part(p.grad)) for p in self.params if p.grad is not None)


def nbytes(tensor: torch.Tensor) -> int:
    """A tensor's own bytes (a gradient shard is a view into its unit's reduce-scatter output:
    the storage would count the whole unit once per parameter)."""
    return tensor.numel() * tensor.element_size()


def make_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  offloaded: OffloadedBytes | None) -> Any:
    """An ``FSDPMemTracker`` that also records the phase of the peak and, with CPU offload, the
    device peak (total minus the offloaded units' state) and the CPU peak separately."""
    from torch.distributed._tools.fsdp2_mem_tracker import _TOTAL_KEY, FSDPMemTracker, _FSDPRefType

    grads_key = _FSDPRefType("Sharded Grad")

    class _Tracker(FSDPMemTracker):
        def __init__(self) -> None:
            super().__init__(model, optimizer)
            self.total_peak = (-1, "", "", {})  # bytes, phase, module, categories
            self.device_peak = (-1, "", "", {})
            self.cpu_peak = 0
            self.grads_seen = -1  # the sharded-gradient total when the offloaded bytes were last read
            self.on_cpu = 0
            self.generating = False  # (online RL: its completions are being generated)
            self.generation_peak = 0

        def where(self) -> tuple[str, str]:
            # Module names are qualified by the root's class name: "Transformer.layers.3.attention".
            active = [name for name in self._mod_tracker.parents if name != "Global"]
            innermost = max(active, key=lambda name: name.count("."), default="")
            module = innermost.partition(".")[2]
            if self._in_opt:
                return "optimizer", ""
            if self.generating:
                return "generation", module
            if self._mod_tracker.is_bw:
                # Inside no block and no unit (at most the root): the loss's and logits' backward.
                return "backward", module or "loss"
            return ("forward" if active else "loss"), module or ("model" if active else "")

        def categories(self) -> dict[str, int]:
            return _by_category(self._curr_mem_snap)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Called after every op: only totals here, the breakdown when a peak is exceeded.
            snapshot = self._curr_mem_snap
            total = sum(per_device[_TOTAL_KEY] for per_device in snapshot.values())
            if offloaded is not None:
                grads = sum(per_device.get(grads_key, 0) for per_device in snapshot.values())
                if grads != self.grads_seen:  # only a gradient's arrival or release changes it
                    self.grads_seen, self.on_cpu = grads, offloaded.now()
            on_cpu = self.on_cpu
            if total > self.total_peak[0]:
                self.total_peak = (total, *self.where(), self.categories())
            if self.generating:
                self.generation_peak = max(self.generation_peak, total - on_cpu)
            if total - on_cpu > self.device_peak[0]:
                self.device_peak = (total - on_cpu, *self.where(), self.categories())
            self.cpu_peak = max(self.cpu_peak, on_cpu)

    return _Tracker()


class LocalOptimizer:
    """The trainer's optimizer, stepping the shards' local tensors, with its state already made.

    - State: Adam's ``step``, ``exp_avg`` and ``exp_avg_sq`` exist before the tracked step, as
      after a real first step, so the one tracked step is a steady-state one (a real run's
      first step holds less: no optimizer state during its forward and backward).
    - Local tensors: an optimizer step on DTensors dispatches each foreach op to the same op on
      the local shards; the first time, DTensor also works out the op's sharding and output
      shapes over every parameter, which on fake tensors takes seconds and allocates nothing.
      This twin (same class, parameter groups and hyperparameters; parameters and gradients
      alias the DTensors' local storage) runs the local ops directly: the same temporaries.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        groups = []
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                local = local_part(param).detach()
                self.pairs.append((param, local))
                params.append(local)
            groups.append({**group, "params": params})
        eight_bit = type(optimizer).__name__ == "AdamW8bit"
        self.optimizer = EightBitTwin(groups) if eight_bit else type(optimizer)(groups)
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for local in group["params"]:
                self.optimizer.state[local] = {
                    # A literal, as Adam makes it: fake tensors keep its value for ``step.item()``.
                    "step": torch.tensor(0.0, dtype=torch.float32, device=local.device if on_device else "cpu"),
                    **_moment(local, "exp_avg", eight_bit), **_moment(local, "exp_avg_sq", eight_bit),
                }

    def step(self) -> None:
        """One step on the gradients the DTensor parameters hold now."""
        for param, local in self.pairs:
            local.grad = None if param.grad is None else local_part(param.grad)
        self.optimizer.step()
        for _, local in self.pairs:
            local.grad = None


EIGHT_BIT_BLOCK = 256
"""torchao's 8-bit optimizer state: values per block (each block one fp32 scale)."""


def _moment(local: torch.Tensor, name: str, eight_bit: bool) -> dict[str, torch.Tensor]:
    """One Adam moment of the local parameter ``local``, by state name: its fp32 copy, or as
    torchao's AdamW8bit keeps it (a tensor of 4,096 values or more that divides into blocks: one
    byte a value and an fp32 scale a block; a smaller one in fp32, as bitsandbytes does)."""
    if eight_bit and local.numel() >= 4096 and local.numel() % EIGHT_BIT_BLOCK == 0:
        return {name: torch.empty(local.numel(), dtype=torch.int8, device=local.device),
                f"{name}_scale": torch.empty(local.numel() // EIGHT_BIT_BLOCK, dtype=torch.float32,
                                             device=local.device)}
    return {name: torch.zeros_like(local, memory_format=torch.preserve_format)}


class EightBitTwin(torch.optim.Optimizer):
    """torchao's AdamW8bit as the estimate's fake tensors see it: its compiled step, one parameter
    at a time, dequantizes the parameter's two moments to fp32, updates and requantizes them; the
    fp32 copies of one parameter's moments are its temporaries."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    moments = [torch.empty(param.shape, dtype=torch.float32, device=param.device) for _ in range(2)]
                    del moments


def as_sharded_params(categories: dict[str, int], nbytes: int) -> dict[str, int]:
    """``categories`` with ``nbytes`` moved from the activations to the sharded parameters (where
    the activations hold them)."""
    if categories.get("activations", 0) < nbytes:
        return categories
    return {**categories, "activations": categories["activations"] - nbytes,
            "sharded_params": categories["sharded_params"] + nbytes}


def local_part(tensor: Any) -> Any:
    """A DTensor's local shard (sharing its storage); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _by_category(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A tracker snapshot summed over devices, keyed by our category names (no total)."""
    return {k: v for k, v in by_category(snapshot).items() if k != "total"}


class GlooAllGather(AllGatherComm):
    """FSDP2's all-gather as gloo runs it: gloo gathers into a buffer of its own the size of
    the output (on its worker thread), then copies it into FSDP's output and frees it. Seen in
    the allocator's trace of a pipeline rank's backward at data parallel 2 (the step's peak, one
    unit's bytes above FSDP's own buffers); NCCL gathers into FSDP's output directly."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist

        scratch = torch.empty_like(output_tensor) if dist.get_world_size(group) > 1 else None
        # (all_gather_single: its name in torch 2.13, where all_gather_into_tensor warns that it is deprecated)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(output_tensor, input_tensor, group=group, async_op=async_op)
        del scratch
        return work


def gloo_all_gathers(model: torch.nn.Module) -> None:
    """Every FSDP unit of ``model`` gathers as gloo does (:class:`GlooAllGather`)."""
    set_custom_all_gather(model, GlooAllGather())
