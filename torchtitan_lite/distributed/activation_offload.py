"""Activation offload: what checkpointed blocks keep between forward and backward, in host memory.

A block under full (or per-operator) activation checkpointing keeps its input from its forward
until its backward recomputes it: at 2M tokens on 8 ranks, 256K × 4,096 × 2 bytes = 2 GiB per
block and 64 GiB for Llama-3.1 8B's 32 blocks, on every rank. :class:`ActivationOffload` moves
those tensors to host memory as the forward saves them and brings each back when its block's
backward starts, so that device memory holds about one block's working set whatever the depth:

- **forward**: every tensor a checkpointed block's autograd saves outside its recomputed region
  (the block's inputs; :func:`torch.autograd.graph.saved_tensors_hooks` around the block's
  checkpoint) is copied into a host buffer, and the device tensor is freed once nothing else
  holds it. On CUDA the copy runs on a side stream into pinned memory, the device memory kept
  for that stream until the copy is done (``record_stream``); the compute stream goes on.
- **backward**: blocks run backward in the reverse order, so when a block's input comes back,
  the one before it is copied back on the side stream at once (one block ahead), overlapping
  the recomputation and backward of this block.

On a CPU the same path runs and the copies are real: the host buffers are numpy's memory, which
PyTorch's allocator does not count, so the allocator's peak is the "device" side and
:attr:`ActivationOffload.host_peak` the host side (the tests measure both). Parameters and
tensors smaller than :data:`MIN_BYTES` stay where they are. The values are copied bit for bit:
training is exactly what it is without offload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["MIN_BYTES", "ActivationOffload"]

MIN_BYTES = 1 << 16
"""Saved tensors smaller than this (64 KiB: positions, masks of short rows) are not moved."""


@dataclass(eq=False)
class _Held:
    """One saved tensor in host memory: its buffer (None for a fake tensor of the memory
    estimate: only its shape), where it goes back to, and (on CUDA) the copy in flight in either
    direction."""

    host: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    index: int
    copied: Any = None  # (CUDA: the event that ends the device-to-host copy)
    spec: Any = None  # (a DTensor's: mesh, placements, shape and stride, to rebuild it around its local part)
    back: torch.Tensor | None = None  # (a prefetched device copy)
    back_ready: Any = None
    nbytes: int = field(default=0)


class ActivationOffload:
    """Saved-tensor hooks that keep checkpointed blocks' saved tensors in host memory (see the
    module's text). One per model; :meth:`around` wraps a block's checkpointed forward."""

    def __init__(self) -> None:
        self._order: list[_Held] = []  # (this step's held tensors, in forward order)
        self._stream: Any = None
        self.host_bytes = 0
        """Bytes in host buffers now."""
        self.host_peak = 0
        """The most bytes held in host buffers at once (since :meth:`start_step`)."""

    def start_step(self) -> None:
        """Before a step's first forward: the peak counts from here, and the held tensors of
        earlier steps (all back on the device) are forgotten."""
        self._order.clear()
        self.host_peak = self.host_bytes

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Within: the tensors autograd saves go to host memory (the block's checkpoint saves its
        inputs there; what the recomputed region saves is the checkpoint's own)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, tensor: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):  # (tensor parallel's sequence shards: the local part moves)
            if not tensor.requires_grad:
                return tensor
            held = self._pack(tensor.to_local().detach().requires_grad_())
            if isinstance(held, _Held):
                held.spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            return held if isinstance(held, _Held) else tensor
        nbytes = tensor.numel() * tensor.element_size()
        fake = isinstance(tensor, FakeTensor)
        # (the blocks' hidden states: what needs a gradient; masks, positions and RoPE tables are
        # shared by every block and stay)
        if isinstance(tensor, nn.Parameter) or not tensor.requires_grad or nbytes < MIN_BYTES \
                or tensor.layout != torch.strided or (type(tensor) is not torch.Tensor and not fake):
            return tensor
        copied = None
        if fake:  # (the memory estimate: the device memory freed, the host side only counted)
            host = None
        elif tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            tensor.record_stream(stream)  # (its memory is not reused before the copy is done)
        else:  # numpy's memory: PyTorch's allocator (the "device" side here) does not count it
            host = torch.from_numpy(np.empty(tensor.shape, dtype=_numpy_dtype(tensor.dtype)))
            if host.dtype != tensor.dtype:
                host = host.view(tensor.dtype)
            host.copy_(tensor)
        held = _Held(host, tensor.shape, tensor.dtype, tensor.device, len(self._order), copied, nbytes=nbytes)
        self._order.append(held)
        self.host_bytes += nbytes
        self.host_peak = max(self.host_peak, self.host_bytes)
        return held

    def _to_device(self, held: _Held, *, wait: bool) -> torch.Tensor:
        if held.host is None:  # (a fake tensor's: its memory again)
            return torch.empty(held.shape, dtype=held.dtype, device=held.device)
        if held.device.type != "cuda":
            return held.host.clone()
        stream = self._side_stream(held.device)
        if held.copied is not None:
            stream.wait_event(held.copied)
        with torch.cuda.stream(stream):
            back = torch.empty(held.host.shape, dtype=held.host.dtype, device=held.device)
            back.copy_(held.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        back.record_stream(torch.cuda.current_stream(held.device))
        if wait:
            torch.cuda.current_stream(held.device).wait_event(ready)
            return back
        held.back, held.back_ready = back, ready
        return back

    def _unpack(self, held: Any) -> torch.Tensor:
        if not isinstance(held, _Held):
            return held
        if held.back is not None:  # (prefetched when the block after it came back)
            if held.back_ready is not None:
                torch.cuda.current_stream(held.device).wait_event(held.back_ready)
            tensor = held.back
        else:
            tensor = self._to_device(held, wait=True)
        held.back = held.back_ready = None
        # The block before this one runs backward next: its input starts coming back now.
        if 0 < held.index <= len(self._order) and held.device.type == "cuda" and held.host is not None:
            previous = self._order[held.index - 1]
            if previous.back is None and previous.nbytes:
                self._to_device(previous, wait=False)
        self._release(held)
        if held.spec is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = held.spec
            return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
        return tensor

    def _release(self, held: _Held) -> None:
        """Count a tensor back on the device as gone from the host (its buffer lives until autograd
        frees the block's graph, in case it is read again)."""
        if held.nbytes:
            self.host_bytes -= held.nbytes
            held.nbytes = 0
        if held.index == 0:  # (the step's first block: every later one is back already)
            self._order.clear()


def _numpy_dtype(dtype: torch.dtype) -> Any:
    """A numpy dtype of ``dtype``'s width (bf16 and float8 as raw unsigned integers, viewed back)."""
    exact = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.uint8: np.uint8,
             torch.int8: np.int8, torch.int16: np.int16}
    if dtype in exact:
        return exact[dtype]
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[torch.empty((), dtype=dtype).element_size()]
