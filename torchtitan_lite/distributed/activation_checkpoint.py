"""Activation checkpointing of a model's blocks, applied from outside the model code.

A checkpointed block keeps, from its forward pass, only what its policy says and recomputes the
rest during backward:

- ``full``: only the block's inputs; the whole block runs again in backward (about one more
  forward of the block: +~33% of the block's FLOPs, the least memory).
- ``op`` (selective by operator): the outputs of the matrix multiplications (``mm``, ``addmm``,
  ``bmm``, ``_scaled_mm``, and a mixture of experts' ``_grouped_mm``, so its experts do not run
  twice; the routing, a few cheap ops, is recomputed) and of the fused attention kernels (every
  ``_scaled_dot_product_*_attention`` variant), which are the expensive ops; everything else
  (norms, RoPE, activations, element-wise products, reshapes) is recomputed. Those cheap ops
  are a few percent of the FLOPs, but their outputs (and the matmul inputs they produce) are
  about half of a Llama block's activations, so this keeps most of the speed of no
  checkpointing at a much lower memory.
- ``none``: nothing is recomputed.

:func:`apply_activation_checkpointing` chooses the policy of each block from TorchTitan's
settings (``mode = "none" | "full" | "selective"``; for ``selective``, ``selective_ac_option =
"op"`` or an integer N: full checkpointing of every N-th block) or takes one policy per block
(what the ``auto`` planner chooses). It must run before ``fully_shard`` and ``torch.compile``
of the blocks, and works on any model: ``blocks`` is what :func:`~.fsdp.apply_fsdp` takes.

The block's class is replaced by a subclass whose ``forward`` runs the original one under
:func:`torch.utils.checkpoint.checkpoint` (non-reentrant), as FSDP2 does for its own hooks: no
wrapper module, so parameter names, ``state_dict`` keys and checkpoints are unchanged, and
``fully_shard`` and ``torch.compile`` (which traces the checkpoint as one region) apply to the
block as before. Recomputation produces bitwise the same values as the first forward on the
same device (no dropout RNG is consumed twice: the RNG state is restored for the recompute).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan_lite.config.schema import every_nth_block
from torchtitan_lite.distributed.fsdp import Blocks, find_blocks

if TYPE_CHECKING:
    from torchtitan_lite.distributed.activation_offload import ActivationOffload

__all__ = [
    "AC_MODES",
    "BlockPolicy",
    "apply_activation_checkpointing",
    "block_policies",
    "checkpoint_policy_of",
    "describe",
    "mlp_tile_count",
    "offload_context",
    "tile_feed_forwards",
]

AC_MODES = ("none", "full", "selective")
BlockPolicy = Literal["none", "full", "op"]
_POLICIES = ("none", "full", "op")

_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)


@functools.cache
def _saved_ops() -> frozenset[Any]:
    """The ``aten`` overloads whose outputs ``op`` keeps (those this PyTorch build has)."""
    ops = set()
    for name in _SAVED_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


_SAVED_CUSTOM_OPS = ("torchtitan_lite::grouped_mm", "_c10d_functional::all_to_all_single",
                     "_c10d_functional::reduce_scatter_tensor")
"""Other operators ``op`` keeps: the experts' grouped products where ``torch._grouped_mm`` is not
used (compiled in fp32; the memory estimator's fake tensors), as ``_grouped_mm`` is kept, expert
parallel's token exchange (recomputing it would move the tokens again) and tensor parallel's
reduce-scatters (the row-wise projections' outputs, ``seq / tp`` positions each). Tensor
parallel's all-gathers of the sequence (the column-wise projections' inputs, the whole
sequence) are gathered again in the recompute rather than kept."""


def _save_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    saved = op in _saved_ops() or op.name() in _SAVED_CUSTOM_OPS
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls_and_attention)


@functools.cache
def _ignore_profiler_ranges() -> None:
    """Leave the profiler's range markers out of selective checkpointing's op count. A block's
    forward and its recompute must dispatch the same ops; FSDP2's hooks of a unit nested in the
    block (an MoE layer's experts under expert parallel) open different ranges in the two (the
    recompute's pre-forward runs as a root's, and an unshard done by a prefetch is not repeated),
    and a range marker carries no data to save or replay."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    for packet in (torch.ops.profiler._record_function_enter, torch.ops.profiler._record_function_enter_new,
                   torch.ops.profiler._record_function_exit):
        SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


def block_policies(mode: str, selective_ac_option: str | int, n_blocks: int) -> list[BlockPolicy]:
    """One policy per block from TorchTitan's settings: ``none`` → all ``none``, ``full`` → all
    ``full``, ``selective`` with ``"op"`` → all ``op``, ``selective`` with N → ``full`` for
    blocks N-1, 2N-1, ... (every N-th block, counting from 1) and ``none`` for the others.

    Raises ``ValueError`` (one line naming the setting) for anything else."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode: invalid value {mode!r}; expected one of "
                         f"{', '.join(AC_MODES)}")
    if mode != "selective":
        return [mode] * n_blocks
    every = _every_nth(selective_ac_option)
    if every is None:
        return ["op"] * n_blocks
    return ["full" if (index + 1) % every == 0 else "none" for index in range(n_blocks)]


def describe(mode: str, selective_ac_option: str | int = "op") -> str:
    """One phrase for logs: ``"selective (op: matmul and attention outputs kept)"``."""
    if mode != "selective":
        return mode
    every = _every_nth(selective_ac_option)
    if every is None:
        return "selective (op: matmul and attention outputs kept)"
    if every == 1:
        return "full"
    suffix = "th" if 10 <= every % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
    return f"selective (every {every}{suffix} block recomputed)"


def _every_nth(option: str | int) -> int | None:
    """None for ``"op"``, N for a positive integer (or its string), else ``ValueError`` (the
    config's rule: :func:`~torchtitan_lite.config.schema.every_nth_block`)."""
    return every_nth_block(option)


@functools.cache
def _checkpointed_class(cls: type[nn.Module], policy: BlockPolicy) -> type[nn.Module]:
    context_fn: Callable[[], Any] | None = None
    if policy == "op":
        _ignore_profiler_ranges()  # once, when the first block takes the op policy
        context_fn = _op_context

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner = super(subclass, self).forward  # the block's own forward
        with offload_context(self):  # (its inputs kept in host memory)
            if context_fn is None:
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    subclass = type(f"Checkpointed{cls.__name__}", (cls,), {
        "forward": forward,
        "__module__": cls.__module__,
        "_activation_checkpoint_policy": policy,
    })
    return subclass


def offload_context(block: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The context a checkpointed ``block``'s forward runs in: its activation offload's hooks
    (:meth:`ActivationOffload.around`) when it has one, else nothing. A compiled block enters it
    around its compiled call (dynamo does not trace the hooks; the compiled graph's saved
    tensors go through them): while dynamo traces, nothing."""
    offload = getattr(block, "_activation_offload", None)
    return contextlib.nullcontext() if offload is None or torch.compiler.is_compiling() else offload.around()


def checkpoint_policy_of(module: nn.Module) -> BlockPolicy:
    """The policy :func:`apply_activation_checkpointing` gave ``module`` (``none`` if none)."""
    return getattr(module, "_activation_checkpoint_policy", "none")


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    blocks: Blocks,
    mode: str = "selective",
    selective_ac_option: str | int = "op",
    policies: Sequence[BlockPolicy] | None = None,
    offload: ActivationOffload | None = None,
    mlp_tiles: int = 1,
) -> list[BlockPolicy]:
    """Checkpoint ``model``'s blocks in place and return each block's policy.

    Args:
        model: the model (on any device, the meta device included), not yet sharded or compiled.
        blocks: the repeated blocks, as :func:`~.fsdp.apply_fsdp` takes them.
        mode, selective_ac_option: TorchTitan's settings (see :func:`block_policies`).
        policies: one of ``"none"``, ``"full"``, ``"op"`` per block instead (overrides ``mode``).
        offload: what the checkpointed blocks keep goes to host memory through it
            (:mod:`~torchtitan_lite.distributed.activation_offload`).
        mlp_tiles: each block's dense feed-forward (its ``feed_forward``) over this many tiles of
            the sequence (:func:`tile_feed_forwards`; 1: off, 0: chosen from the sequence).

    Raises ``ValueError`` (one line) for a bad setting, a list of the wrong length, or a block
    that is already checkpointed, sharded or compiled.
    """
    found = find_blocks(model, blocks)
    if policies is None:
        chosen = block_policies(mode, selective_ac_option, len(found))
    else:
        chosen = list(policies)
        if len(chosen) != len(found) or any(p not in _POLICIES for p in chosen):
            raise ValueError(f"activation checkpointing: expected one of {', '.join(_POLICIES)} for each "
                             f"of the {len(found)} blocks, got {chosen!r}")
    for index, (block, policy) in enumerate(zip(found, chosen, strict=True)):
        if policy == "none":
            continue
        if hasattr(block, "_activation_checkpoint_policy"):
            raise ValueError(f"activation checkpointing: block {index} is already checkpointed")
        if type(block).__name__.startswith("FSDP") or getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError(f"activation checkpointing: block {index} is already sharded or compiled; "
                             "apply activation checkpointing first")
        block.__class__ = _checkpointed_class(type(block), policy)
        if offload is not None:
            block._activation_offload = offload
    if mlp_tiles != 1:
        tile_feed_forwards(found, tiles=mlp_tiles)
    return chosen


def mlp_tile_count(tiles: int, seq_len: int, dim: int) -> int:
    """Tiles of a feed-forward's sequence: ``tiles``, or for 0 ``ceil(seq_len / dim)`` (ALST's
    rule: each tile's wide intermediate about the size of a dim × dim matrix), at least 1."""
    return max(1, tiles if tiles > 0 else -(-seq_len // max(dim, 1)))


@functools.cache
def _tiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inner = super(subclass, self).forward
        count = min(mlp_tile_count(self._mlp_tiles, x.shape[1], x.shape[-1]), x.shape[1])
        if count <= 1:
            return inner(x, *args, **kwargs)
        parts = x.tensor_split(count, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([inner(part, *args, **kwargs) for part in parts], dim=1)
        return torch.cat([checkpoint(inner, part, *args, use_reentrant=False, **kwargs) for part in parts], dim=1)

    subclass = type(f"Tiled{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return subclass


def tile_feed_forwards(blocks: Sequence[nn.Module], *, tiles: int) -> int:
    """Compute each block's dense feed-forward (its ``feed_forward`` child; a mixture of experts'
    layer is left whole: its router's losses read one routing per forward) over ``tiles`` tiles of
    the sequence (0: :func:`mlp_tile_count` of each forward's), each tile recomputed in backward,
    so that the feed-forward's intermediate (its hidden width, several times the model's) exists
    for one tile at a time. A feed-forward is per token: the values are the untiled ones up to
    float rounding. In place (the class is swapped, names and state dict unchanged), before
    ``fully_shard`` and compile; returns how many were tiled."""
    tiled = 0
    for block in blocks:
        feed_forward = getattr(block, "feed_forward", None)
        if feed_forward is None:
            continue
        feed_forward.__class__ = _tiled_class(type(feed_forward))
        feed_forward._mlp_tiles = tiles
        tiled += 1
    return tiled
