"""Context parallel: each sequence split over the ranks of the mesh's ``cp`` dimension.

Every rank of a context-parallel group reads the same samples and keeps only its share of each
sequence: the tokens, labels and document ids go through :meth:`ContextParallel.shard`, and the
model's embedding, blocks, norm, output and loss see only those tokens. Everything that is not
attention is per token, so it needs nothing more; attention is exact over the whole sequence:

- **Load balance** (head-tail, as Megatron-Core and TorchTitan): the sequence is cut into
  ``2 × degree`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 × degree − 1 − r``, so
  that under a causal mask every rank's queries meet as many keys. Positions (RoPE, YaRN) and
  document boundaries are those of the whole sequence.
- ``allgather``: each rank gathers every rank's keys and values (the gather's backward sums
  their gradients back: a reduce-scatter) and attends its own queries to them: any mask (causal,
  block-causal for packed documents, and so chat SFT), as Llama 3 was trained. The mask is a
  FlexAttention BlockMask on CUDA (the blocks above the diagonal skipped); elsewhere the queries
  go in tiles, each with a dense mask of its own keys only
  (:func:`~torchtitan_lite.models.decoder.block_causal_attention`).
- ``ulysses`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards of every head into whole
  sequences of ``heads / degree`` heads, each rank attends over the whole sequence with its
  heads, and a second all-to-all turns the result back. It needs the heads (and key/value heads,
  or they are repeated to the query heads) divisible by the degree.

Attention goes through :meth:`ContextParallel.attention`, which the decoder calls once per
forward with the local document ids (None: causal): the returned :class:`ShardedAttention`
carries each local token's global position and its ``attend(q, k, v)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_lite.models.decoder import (
    SharedSequenceAttention,
    block_causal_attention,
    block_causal_mask,
    compiled_block_mask,
    compiled_flex_attention,
    document_positions,
)

__all__ = ["CP_METHODS", "ContextParallel", "ShardedAttention", "context_parallel_problem"]

CP_METHODS = ("allgather", "ulysses")
"""``parallelism.context_parallel_method``'s values."""


def context_parallel_problem(*, seq_len: int, degree: int, method: str, n_heads: int, kv_heads: int,
                             tensor_parallel: int = 1) -> str | None:
    """What keeps a job from splitting its sequences over ``degree`` ranks with ``method``, as
    one line, or None: the sequence must split into ``2 × degree`` equal chunks (load balance),
    and Ulysses needs each rank's heads (after tensor parallel) divisible by the degree."""
    if degree <= 1:
        return None
    if method not in CP_METHODS:
        return f"unknown method {method!r}; expected one of {', '.join(map(repr, CP_METHODS))}"
    if seq_len % (2 * degree):
        return (f"training.seq_len {seq_len} does not split into 2 × context_parallel_degree = {2 * degree} "
                "equal chunks (the load-balanced split); expected a multiple of it")
    heads = n_heads // tensor_parallel
    if method == "ulysses" and heads % degree:
        return (f"ulysses splits the attention heads over the context-parallel ranks: {heads} heads"
                f"{' per tensor-parallel rank' if tensor_parallel > 1 else ''} do not divide by "
                f"context_parallel_degree {degree}; expected a degree that divides them, or "
                "parallelism.context_parallel_method = 'allgather'")
    return None


@dataclass(frozen=True)
class _Layout:
    """Where the tokens of a sequence of ``seq_len`` are: ``owned[r]``, the global positions rank
    ``r`` holds, in its order; ``gathered_to_global`` puts the ranks' shards, concatenated in rank
    order, back in sequence order; ``global_to_gathered`` the reverse."""

    owned: torch.Tensor  # (degree, seq_len / degree)
    gathered_to_global: torch.Tensor  # (seq_len,)
    global_to_gathered: torch.Tensor  # (seq_len,)
    starts: tuple[tuple[int, int], ...]  # each rank's two chunks' first global positions
    chunk: int  # tokens per chunk


class ContextParallel:
    """Sequences split over ``group`` (the mesh's ``cp`` dimension) with ``method`` (see the
    module's docstring)."""

    def __init__(self, group: Any, *, method: str = "allgather", load_balance: bool = True) -> None:
        if method not in CP_METHODS:
            raise ValueError(f"context parallel: unknown method {method!r}; expected one of {CP_METHODS}")
        self.group, self.method, self.load_balance = group, method, load_balance
        self.degree, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._layouts: dict[tuple[int, str], _Layout] = {}
        self.shapes_only = False
        """Set by the memory estimator (fake tensors): attention without its mask tensor, as on
        CUDA, where the mask is a BlockMask of a few bytes per block."""

    def layout(self, seq_len: int, device: torch.device) -> _Layout:
        """The load-balanced split of a sequence of ``seq_len`` tokens (cached; without
        ``load_balance``, contiguous: rank ``r`` holds the ``r``-th of ``degree`` chunks, which a
        causal mask makes the last rank's work ``2 × degree − 1`` times the first's)."""
        key = (seq_len, str(device))
        if key not in self._layouts:
            n = 2 * self.degree
            if seq_len % n:
                raise ValueError(f"context parallel: a sequence of {seq_len} tokens does not split into {n} equal "
                                 "chunks")
            chunk = seq_len // n
            if self.load_balance:
                starts = [(r * chunk, (n - 1 - r) * chunk) for r in range(self.degree)]
            else:
                starts = [(2 * r * chunk, (2 * r + 1) * chunk) for r in range(self.degree)]
            owned = torch.stack([torch.cat([torch.arange(a, a + chunk), torch.arange(b, b + chunk)])
                                 for a, b in starts]).to(device)
            order = owned.flatten()  # the global position at each place of the rank-ordered concatenation
            self._layouts[key] = _Layout(owned=owned, gathered_to_global=torch.argsort(order),
                                         global_to_gathered=order, starts=tuple(starts), chunk=chunk)
        return self._layouts[key]

    def shard_batch(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """This rank's tokens of each ``(bs, seq)`` tensor (tokens, labels, document ids; None
        passes through)."""
        return tuple(None if t is None else self.shard(t) for t in tensors)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` (whole sequences along ``dim``)."""
        positions = self.layout(x.shape[dim], x.device).owned[self.rank]
        return x.index_select(dim, positions)

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Whole sequences of ``x``, this rank's tokens along ``dim`` (:meth:`shard`'s inverse: every
        rank's share gathered, in sequence order; differentiable)."""
        return self._gather_sequence(x.contiguous(), dim=dim, layout=self.layout(x.shape[dim] * self.degree, x.device))

    def attention(self, local_len: int, document_ids: torch.Tensor | None, device: torch.device,
                  *, flex: bool | None = None) -> ShardedAttention:
        """What one forward's attention layers need (a collective when ``document_ids``, this
        rank's ``(bs, local_len)`` shard, are given: they are gathered)."""
        layout = self.layout(local_len * self.degree, device)
        documents = None
        if document_ids is not None:
            documents = self._gather_sequence(document_ids.contiguous(), dim=1, layout=layout)
        return ShardedAttention(self, layout, documents,
                                flex=(device.type == "cuda") if flex is None else flex)

    # -- collectives ---------------------------------------------------------------------------

    def _gather_sequence(self, x: torch.Tensor, *, dim: int, layout: _Layout) -> torch.Tensor:
        """Every rank's shard of ``x`` along ``dim``, in sequence order (differentiable)."""
        import torch.distributed._functional_collectives as funcol

        # (all_gather_single_autograd: its name from torch 2.12 on; the earlier one is deprecated there)
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        gathered = gather(x.contiguous(), gather_dim=dim, group=self.group)
        return gathered.index_select(dim, layout.gathered_to_global)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(degree, …)``: part ``j`` goes to rank ``j``; returns part ``i`` from rank ``i``
        (differentiable)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        out = all_to_all_single_autograd(x.contiguous().flatten(), None, None, self.group)
        return out.view(x.shape)


class ShardedAttention(SharedSequenceAttention):
    """One forward's attention under context parallel: :attr:`positions` (each local token's
    position in its sequence, or in its document with ``documents``) and :meth:`attend`."""

    def __init__(self, cp: ContextParallel, layout: _Layout, documents: torch.Tensor | None, *, flex: bool) -> None:
        self.cp, self.layout, self.documents, self.flex = cp, layout, documents, flex
        self._block_mask: Any = None  # a CUDA BlockMask, built by the first layer, shared by the others
        self.query_positions = layout.owned[cp.rank]  # (local,) global positions of this rank's tokens
        if documents is None:
            self.positions = self.query_positions
        else:
            self.positions = document_positions(documents).index_select(1, self.query_positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool = False,
               scale: float | None = None) -> torch.Tensor:
        """Exact attention of this rank's queries ``q`` ``(bs, heads, local, d)`` over the whole
        sequence, given this rank's keys and values (``(bs, kv_heads, local, d)``)."""
        if self.cp.method == "ulysses":
            return self._ulysses(q, k, v, enable_gqa=enable_gqa, scale=scale)
        layout = self.layout
        k_all = self.cp._gather_sequence(k, dim=2, layout=layout)
        v_all = self.cp._gather_sequence(v, dim=2, layout=layout)
        if self.cp.shapes_only:
            return F.scaled_dot_product_attention(q, k_all, v_all, scale=scale, enable_gqa=enable_gqa)
        if self.flex:
            if self._block_mask is None:
                self._block_mask = self._flex_mask(q.shape[2])
            return compiled_flex_attention()(q, k_all, v_all, block_mask=self._block_mask, scale=scale,
                                             enable_gqa=enable_gqa)
        # Each of this rank's two chunks against the keys up to its end only (the keys after it are
        # masked for all its queries), over tiles of queries: no mask of the queries over the sequence.
        chunk = self.layout.chunk
        return torch.cat([block_causal_attention(q[:, :, i * chunk:(i + 1) * chunk], k_all, v_all, self.documents,
                                                 start=start, scale=scale, enable_gqa=enable_gqa)
                          for i, start in enumerate(self.layout.starts[self.cp.rank])], dim=2)

    def _flex_mask(self, local: int) -> Any:
        """The CUDA BlockMask of this rank's queries over the whole sequence: a query attends to the
        keys at or before its position (in its own document); the blocks above the diagonal skipped.
        Made block by block (:func:`~torchtitan_lite.models.decoder.compiled_block_mask`), never as
        a dense mask of the queries over the sequence."""
        documents, positions = self.documents, self.query_positions

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            qpos = positions[q]
            causal = kv <= qpos
            return causal if documents is None else causal & (documents[b, qpos] == documents[b, kv])

        rows = 1 if documents is None else documents.shape[0]
        return compiled_block_mask()(mask_mod, rows, None, local, local * self.cp.degree, device=positions.device)

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool,
                 scale: float | None) -> torch.Tensor:
        degree = self.cp.degree
        if enable_gqa and k.shape[1] % degree:  # too few key/value heads to split: repeat them to the queries'
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            enable_gqa = False
        qh, kh, vh = (self._sequence_to_heads(t) for t in (q, k, v))
        if self.documents is None or self.cp.shapes_only:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        elif self.flex:
            if self._block_mask is None:  # (one per forward, shared by the layers)
                self._block_mask = block_causal_mask(self.documents, flex=True)
            out = compiled_flex_attention()(qh, kh, vh, block_mask=self._block_mask, scale=scale, enable_gqa=enable_gqa)
        else:
            out = block_causal_attention(qh, kh, vh, self.documents, scale=scale, enable_gqa=enable_gqa)
        return self._heads_to_sequence(out)

    def _sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(bs, heads, local, d)`` → ``(bs, heads / degree, seq, d)`` in sequence order."""
        degree, (bs, heads, local, d) = self.cp.degree, x.shape
        parts = x.reshape(bs, degree, heads // degree, local, d).transpose(0, 1)  # head group j → rank j
        got = self.cp._all_to_all(parts)  # (degree, bs, heads/degree, local, d): rank i's tokens
        whole = got.permute(1, 2, 0, 3, 4).reshape(bs, heads // degree, degree * local, d)
        return whole.index_select(2, self.layout.gathered_to_global)

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_sequence_to_heads`."""
        degree, (bs, group, total, d) = self.cp.degree, x.shape
        ranked = x.index_select(2, self.layout.global_to_gathered)
        parts = ranked.reshape(bs, group, degree, total // degree, d).permute(2, 0, 1, 3, 4)  # rank i's tokens → i
        got = self.cp._all_to_all(parts)  # (degree, bs, group, local, d): head group j from rank j
        return got.transpose(0, 1).reshape(bs, degree * group, total // degree, d)

