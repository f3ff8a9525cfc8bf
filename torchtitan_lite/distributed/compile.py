"""``torch.compile`` of a model's blocks and of the loss, applied from outside the model code.

Each block is compiled on its own with ``fullgraph=True`` (a graph break is an error, not a
silent slowdown). Blocks of one class share their compiled code: dynamo treats the block's
parameters as inputs, so a model of 32 identical blocks compiles once, not 32 times. The whole
model is not compiled as one graph: FSDP2's all-gathers and reduce-scatters run in the hooks
around each block, outside the compiled regions, exactly as in eager mode.

As with activation checkpointing (:mod:`.activation_checkpoint`), the block's class is replaced
by a subclass whose ``forward`` is the compiled original: parameter names, ``state_dict`` keys
and checkpoints are unchanged, and ``fully_shard`` applied afterwards puts its hooks outside the
compiled code. Apply activation checkpointing first (the checkpoint becomes part of the graph),
then compile, then ``fully_shard``.

The first call of each block compiles (seconds to minutes); later calls with the same shapes,
dtypes and grad mode reuse the code. A forward without gradients (validation) compiles its own
graph once.

On a CPU without native bf16 matrix multiplication (AVX2 only: oneDNN's bf16 kernels are not
available, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), every bf16 ``mm`` runs
ATen's reference loop, 5-50x slower than fp32 (by operand layout). There the compiled blocks
compute each bf16 ``F.linear`` on CPU as an fp32 one on upcast operands, rounded back to bf16
(:class:`Bf16LinearInFp32`, traced into the graph so that inductor fuses the casts): the
accumulation is fp32 either way, so results differ from eager only by summation order (within
one bf16 rounding step), and forward and backward run fp32 GEMMs. Elsewhere nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from torchtitan_lite.distributed.activation_checkpoint import offload_context
from torchtitan_lite.distributed.fsdp import Blocks, find_blocks

__all__ = ["Bf16LinearInFp32", "bf16_linear_in_fp32", "compile_blocks", "compile_loss", "compiles_by_parts",
           "is_compiled"]

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def bf16_linear_in_fp32() -> bool:
    """Whether compiled blocks compute CPU bf16 linears in fp32: the CPU has no native bf16
    matrix multiplication (oneDNN's bf16 kernels unavailable)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Bf16LinearInFp32(TorchFunctionMode):
    """Under this mode, ``F.linear`` of a bf16 CPU input runs in fp32 (operands upcast exactly,
    the result rounded to bf16); every other call is unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is functional.linear and args[0].dtype == torch.bfloat16 and args[0].device.type == "cpu":
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return func(*args, **kwargs)


@functools.cache
def _compiled_class(cls: type[nn.Module], backend: str) -> type[nn.Module]:
    def with_fp32_linears(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with Bf16LinearInFp32():  # traced by dynamo: the casts are part of the graph (and its cache key)
            return cls.forward(self, *args, **kwargs)

    traced = with_fp32_linears if bf16_linear_in_fp32() else cls.forward
    compiled_forward = torch.compile(traced, backend=backend, fullgraph=True)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # A block may leave a record of its forward on a module (a mixture of experts' routing,
        # read by the router losses); inside activation checkpointing dynamo keeps it from the
        # forward and leaves it out of the recomputation. Activation offload's hooks are set
        # here, outside the graph: what the compiled block saves goes through them.
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True), offload_context(self):
            return compiled_forward(self, *args, **kwargs)

    return type(f"Compiled{cls.__name__}", (cls,), {
        "forward": forward,
        "__module__": cls.__module__,
        "_compiled_with": backend,
    })


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``."""
    return hasattr(module, "_compiled_with")


def compiles_by_parts(*, compile_model: bool, expert_parallel: int) -> bool:
    """Whether a job's blocks are compiled by their parts (see :func:`compile_blocks`): compiled
    blocks whose mixtures of experts exchange tokens with other ranks (expert parallel). Such
    blocks take neither selective (op) checkpointing nor ``auto``, which may choose it, yet."""
    return compile_model and expert_parallel > 1


def compile_blocks(model: nn.Module, *, blocks: Blocks, backend: str = "inductor", by_parts: bool = False) -> int:
    """Compile each of ``model``'s blocks in place (before ``fully_shard``); returns how many.

    ``by_parts`` (:func:`compiles_by_parts`: expert parallel, whose all-to-all exchange sizes are
    data and whose experts are an FSDP unit of their own): a block with a mixture of experts is
    compiled by its parts instead, as TorchTitan does: each child, and of the mixture of experts
    its router, shared experts and experts' products, each its own graph, the exchange and the
    experts' FSDP hooks between them eager (so is the block's checkpoint).

    ``blocks`` is what :func:`~.fsdp.apply_fsdp` takes. Raises ``ValueError`` (one line) for a
    block that is already compiled or sharded, or whose experts exchange tokens with other ranks
    without ``by_parts``."""
    found = find_blocks(model, blocks)
    for index, block in enumerate(found):
        if is_compiled(block) or type(block).__name__.startswith("FSDP"):
            raise ValueError(f"compile: block {index} is already compiled or sharded; compile the "
                             "blocks once, before apply_fsdp")
        parts = _parts_of(block)
        if parts and not by_parts:
            raise ValueError(f"compile: block {index}'s mixture of experts exchanges tokens with other ranks "
                             "(expert parallel), which one graph cannot hold; compile it with by_parts=True")
        for part in parts or (block,):
            part.__class__ = _compiled_class(type(part), backend)
        if parts:
            block._compiled_with = backend  # (by its parts)
    return len(found)


def _parts_of(block: nn.Module) -> list[nn.Module]:
    """The parts a block whose mixture of experts exchanges tokens with other ranks is compiled
    by (see :func:`compile_blocks`); empty for any other block."""
    from torchtitan_lite.distributed.expert_parallel import AllToAllDispatcher

    layers = [child for child in block.children() if isinstance(getattr(child, "dispatcher", None), AllToAllDispatcher)]
    if not layers:
        return []
    parts = [child for child in block.children() if child not in layers]
    for layer in layers:
        parts += [child for child in layer.children()]
    return parts


def compile_loss(loss_fn: F, *, backend: str = "inductor") -> F:
    """``loss_fn`` compiled as one graph (e.g. :func:`torchtitan_lite.loss.token_loss_sum`: the
    logits' upcast, log-softmax and gather fuse into fewer passes over the logits)."""
    return torch.compile(loss_fn, backend=backend, fullgraph=True)
