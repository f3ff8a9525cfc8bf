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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from torchtitan_lite.distributed.fsdp import Blocks, find_blocks

__all__ = ["compile_blocks", "compile_loss", "is_compiled"]

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _compiled_class(cls: type[nn.Module], backend: str) -> type[nn.Module]:
    compiled_forward = torch.compile(cls.forward, backend=backend, fullgraph=True)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return compiled_forward(self, *args, **kwargs)

    return type(f"Compiled{cls.__name__}", (cls,), {
        "forward": forward,
        "__module__": cls.__module__,
        "_compiled_with": backend,
    })


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``."""
    return hasattr(module, "_compiled_with")


def compile_blocks(model: nn.Module, *, blocks: Blocks, backend: str = "inductor") -> int:
    """Compile each of ``model``'s blocks in place (before ``fully_shard``); returns how many.

    ``blocks`` is what :func:`~.fsdp.apply_fsdp` takes. Raises ``ValueError`` (one line) for a
    block that is already compiled or sharded."""
    found = find_blocks(model, blocks)
    for index, block in enumerate(found):
        if is_compiled(block) or type(block).__name__.startswith("FSDP"):
            raise ValueError(f"compile: block {index} is already compiled or sharded; compile the "
                             "blocks once, before apply_fsdp")
        block.__class__ = _compiled_class(type(block), backend)
    return len(found)


def compile_loss(loss_fn: F, *, backend: str = "inductor") -> F:
    """``loss_fn`` compiled as one graph (e.g. :func:`torchtitan_lite.loss.token_loss_sum`: the
    logits' upcast, log-softmax and gather fuse into fewer passes over the logits)."""
    return torch.compile(loss_fn, backend=backend, fullgraph=True)  # type: ignore[return-value]
