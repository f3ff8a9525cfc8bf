"""The decoder-only Transformer our model families share, built from its args.

RMSNorm; rotary position embeddings on interleaved pairs (as in Meta's Llama reference; the
rotations live in a non-persistent complex buffer and reach the blocks as :func:`rope_bits`),
with the frequencies scaled as the args say (``args.scale_rope_frequencies``); grouped-query attention through
``scaled_dot_product_attention``, optionally with an RMSNorm over each head's queries and keys
before RoPE (``qk_norm``, Qwen3) or biases on the query, key and value projections
(``qkv_bias``, Qwen2), or a family's own attention (``args.attention_cls``: DeepSeek-V3's latent
attention); a SwiGLU feed-forward, or a mixture of experts (:class:`~torchtitan_lite.models.moe.MoE`)
in the layers the args name (:func:`is_moe_layer`); an output projection optionally tied to the
token embedding. A family (``models/<family>/``) supplies the args: a frozen dataclass with
``dim``, ``n_layers``, ``n_heads``, ``kv_heads``, ``head_dim``, ``ffn_hidden_dim``,
``vocab_size``, ``norm_eps``, ``rope_theta``, ``max_seq_len``, ``depth_init``,
``tie_word_embeddings``, ``qk_norm`` and ``qkv_bias``, and the method ``scale_rope_frequencies(inv_freq)``.

Nothing here knows about FSDP: the model can be built on the meta device, sharded by
:mod:`torchtitan_lite.distributed.fsdp`, materialised with ``to_empty`` and then filled by
:meth:`Decoder.init_weights`.

Generation: ``forward(tokens, cache=KVCache(...))`` runs left-padded prompts once (prefill), then
one token per row per call, each layer's keys and values kept in the :class:`KVCache`
(:mod:`torchtitan_lite.rl.rollout` samples from it).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

import torchtitan_lite.models.init as init
from torchtitan_lite.models.feed_forward import FeedForward
from torchtitan_lite.models.kv_cache import CachedAttention, KVCache
from torchtitan_lite.models.moe import MoE, grouped_mm_available
from torchtitan_lite.models.spec import FSDPLayout

__all__ = ["ATTENTION_TILE_ELEMENTS", "CachedAttention", "Decoder", "DocumentMask", "KVCache",
           "SharedSequenceAttention", "apply_rotary_emb", "attend", "block_causal_attention", "block_causal_mask",
           "compiled_block_mask", "compiled_flex_attention", "decoder_fsdp_units", "document_positions",
           "is_moe_layer", "precompute_freqs_cis", "rope_bits"]

def precompute_freqs_cis(
    head_dim: int, max_seq_len: int, theta: float, *, device: torch.device | str | None = None,
    args: Any = None,
) -> torch.Tensor:
    """Return the ``(max_seq_len, head_dim // 2)`` complex64 rotations ``exp(i · pos · freq)``,
    the frequencies scaled by ``args.scale_rope_frequencies`` when ``args`` is given.

    Kept complex (the buffer is not a floating-point tensor, so nothing casts it); the blocks
    get it as :func:`rope_bits`.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    )
    if args is not None:
        inv_freq = args.scale_rope_frequencies(inv_freq)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def rope_bits(freqs_cis: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` rotations as the raw bits (``int32``) of their float32 cos/sin pairs.

    This is the form the blocks receive: FSDP's mixed precision casts floating-point inputs of
    a unit to the compute dtype, which would round the table to bf16; integer tensors pass
    unchanged, and reading them back as float32 is free (a bit-cast view).
    """
    return torch.view_as_real(freqs_cis[:seq_len]).view(torch.int32)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of ``x: (bs, seq, heads, head_dim)`` by the
    table ``freqs_cis`` (complex, or its :func:`rope_bits`).

    Eagerly the product with ``exp(i·θ)`` is one complex multiply (half the operations of the
    real form, forward and backward: each a memory-bound kernel on a GPU). Compiled, and on
    DTensors, it is written with real cos/sin arithmetic, which inductor generates code
    for (it does not for complex operators); the two give the same values, bit for bit on CPU.
    """
    bs, seq_len, head_dim = x.shape[0], x.shape[1], x.shape[-1]
    table = freqs_cis.view(torch.float32) if freqs_cis.dtype == torch.int32 else torch.view_as_real(freqs_cis)
    if table.dim() == 4:  # per sample and position (bs, seq, head_dim // 2, 2): positions restart per document
        table = table.view(bs, seq_len, 1, head_dim // 2, 2)
    else:
        table = table[:seq_len].view(1, seq_len, 1, head_dim // 2, 2)
    if not isinstance(x, DTensor) and not torch.compiler.is_compiling():
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], head_dim // 2, 2))
        return torch.view_as_real(pairs * torch.view_as_complex(table)).flatten(-2).type_as(x)
    cos, sin = table[..., 0], table[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], head_dim // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(x, DTensor) and not isinstance(weight, DTensor):
            if x.is_cuda:  # one fused kernel each way, saving the input and a scalar a row
                return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
            if _CUDA_KERNELS_ON_CPU and isinstance(x, FakeTensor):  # (the memory estimate of that)
                return _FusedNormShapes.apply(x, weight)
        # (off CUDA, and under tensor parallel: composite, in fp32)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * weight

    def init_weights(self) -> None:
        init.ones_(self.weight)


class Attention(nn.Module):
    tensor_parallel_columns = ("wq", "wk", "wv")
    """The linears a tensor-parallel split divides by output features (heads; biases with them)."""
    tensor_parallel_rows = ("wo",)
    """The linears it divides by input features (their partial sums reduce-scattered)."""
    tensor_parallel_whole: tuple[str, ...] = ()
    """What runs whole on every rank (the per-head norms run on each rank's heads)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Per-head RMSNorm of queries and keys before RoPE (Qwen3): weights over head_dim.
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        # (-1: the heads this rank computes, all of them but under tensor parallel)
        q = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = attend(q, k, v, mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                init.zeros_(linear.bias)
        init.trunc_normal_(self.wo.weight, std=out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()


_CUDA_KERNELS_ON_CPU = False
"""Set by :func:`kernels_as_on_cuda` (the memory estimate of a CUDA job, run on CPU)."""


@contextlib.contextmanager
def kernels_as_on_cuda() -> Iterator[None]:
    """Within, CPU tensors hold what CUDA's kernels would, for the memory estimate of a CUDA job:

    - attention whose values are narrower than its keys (DeepSeek's latent attention: 128
      against 192) runs the fused kernel on values zero-padded to the keys' width, then drops the
      padding. PyTorch's CPU kernel takes only equal widths and otherwise falls back to the math
      path, which keeps the ``heads × seq²`` scores for backward; CUDA's memory-efficient kernel
      takes unequal widths and keeps only the output and the log-sum-exp (the padded copy of the
      values and the wider output cost a little more than CUDA holds);
    - :class:`RMSNorm` allocates what CUDA's fused kernel does (its output and each row's
      reciprocal norm; in backward the input's and the weight's gradients), where the CPU
      composite makes and keeps fp32 copies of the whole input."""
    global _CUDA_KERNELS_ON_CPU
    before, _CUDA_KERNELS_ON_CPU = _CUDA_KERNELS_ON_CPU, True
    try:
        yield
    finally:
        _CUDA_KERNELS_ON_CPU = before


class _FusedNormShapes(torch.autograd.Function):
    """The allocations of CUDA's fused RMSNorm (``aten._fused_rms_norm`` and its backward) on the
    estimate's fake CPU tensors, without values: it saves the input and an fp32 reciprocal norm a
    row; backward makes the input's gradient and the weight's (with an fp32 partial sum a row
    block, left out)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


class SharedSequenceAttention(abc.ABC):
    """One forward's attention over a sequence that several ranks hold a share of (context
    parallel's :class:`~torchtitan_lite.distributed.context_parallel.ShardedAttention`): what
    :func:`attend` takes in place of a mask. :attr:`positions`: each local token's position (in
    its sequence, or its document), for RoPE."""

    positions: torch.Tensor

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool = False,
               scale: float | None = None) -> torch.Tensor:
        """This rank's queries ``q`` over the whole sequence's keys and values."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, *, enable_gqa: bool = False,
           scale: float | None = None) -> torch.Tensor:
    """Attention of ``q`` ``(bs, heads, seq, d)`` over ``k``, ``v`` under ``mask``: None (causal),
    a dense ``(bs, 1, seq, seq)`` boolean mask (True attends), a FlexAttention BlockMask, a
    :class:`DocumentMask` (packed documents off CUDA), a
    :class:`SharedSequenceAttention` (context parallel: this rank's queries over the whole sequence)
    or a :class:`CachedAttention` (generation: over the keys and values of a :class:`KVCache`)."""
    if _CUDA_KERNELS_ON_CPU and q.device.type == "cpu" and v.shape[-1] < q.shape[-1] and mask is None:
        width = v.shape[-1]
        padded = F.pad(v, (0, q.shape[-1] - width))
        return F.scaled_dot_product_attention(q, k, padded, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)[..., :width]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if isinstance(mask, (SharedSequenceAttention, CachedAttention)):
        return mask.attend(q, k, v, scale=scale, enable_gqa=enable_gqa)
    if isinstance(mask, DocumentMask):
        return block_causal_attention(q, k, v, mask.document_ids, scale=scale, enable_gqa=enable_gqa)
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        # A family's own attention (args.attention_cls, e.g. DeepSeek-V3's latent attention) or ours.
        self.attention = (getattr(args, "attention_cls", None) or Attention)(args)
        # A mixture of experts in place of the dense feed-forward where the args say so.
        self.moe = MoE.from_args(args) if is_moe_layer(args, layer_id) else None
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim) if self.moe is None else None
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std)
        (self.moe if self.moe is not None else self.feed_forward).init_weights(self.out_std)


def is_moe_layer(args: Any, layer_id: int) -> bool:
    """Whether layer ``layer_id`` of a model with ``args`` is a mixture of experts: args with
    ``num_experts`` > 0 say which layers with ``moe_layer(layer_id)``."""
    return bool(args.num_experts) and bool(args.moe_layer(layer_id))


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document: ``document_ids`` ``(bs, seq)`` numbers the
    packed documents of each row (equal ids next to each other)."""
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def block_causal_mask(document_ids: torch.Tensor, *, flex: bool | None = None) -> Any:
    """The attention mask of packed documents: a token attends to the tokens before it in its own
    document only. A FlexAttention BlockMask on CUDA (``flex``; the sparse blocks are skipped; made
    by :func:`compiled_block_mask` without a dense mask); elsewhere a :class:`DocumentMask`, which
    :func:`attend` computes over tiles of queries (FlexAttention has no backward on CPU)."""
    bs, seq_len = document_ids.shape
    if document_ids.is_cuda if flex is None else flex:
        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (document_ids[b, q] == document_ids[b, kv]) & (kv <= q)

        return compiled_block_mask()(mask_mod, bs, None, seq_len, seq_len, device=document_ids.device)
    return DocumentMask(document_ids)


class DocumentMask:
    """Packed documents' mask off CUDA: ``document_ids`` ``(bs, seq)``; :func:`attend` runs
    :func:`block_causal_attention` with it, never a dense mask of the whole sequence."""

    def __init__(self, document_ids: torch.Tensor) -> None:
        self.document_ids = document_ids

    def dense(self) -> torch.Tensor:
        """The dense ``(bs, 1, seq, seq)`` boolean mask (True attends): for comparisons only."""
        return _tile_mask(self.document_ids, 0, self.document_ids.shape[1], self.document_ids.shape[1])


ATTENTION_TILE_ELEMENTS = 1 << 22
"""Off CUDA, a masked attention's scores exist for at most this many (row, head, query, key)
elements at a time (16 MiB in fp32): :func:`block_causal_attention`'s tiles."""


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                           *, start: int = 0, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Exact causal attention of the queries ``q`` ``(bs, heads, n, d)`` at positions ``start`` to
    ``start + n - 1`` of a sequence, over its keys and values ``k``, ``v`` ``(bs, kv_heads, keys,
    d)`` at positions 0 onwards (those after the last query are never attended); within each
    token's document when ``documents`` ``(bs, keys)`` numbers them.

    Off CUDA (no FlexAttention backward), without a mask or score matrix of the whole sequence:
    the queries go in tiles whose scores hold at most :data:`ATTENTION_TILE_ELEMENTS` elements,
    each against the keys up to its last query, with a dense mask of that tile only; each tile is
    recomputed in backward (``torch.utils.checkpoint``), so a step's memory grows linearly with
    the sequence. A sequence short enough for one tile is one ``scaled_dot_product_attention``."""
    from torch.utils.checkpoint import checkpoint

    bs, heads, n, _ = q.shape
    rows = max(16, ATTENTION_TILE_ELEMENTS // max(1, bs * heads * (start + n)))
    if rows >= n:
        return _attention_tile(q, k[:, :, :start + n], v[:, :, :start + n], documents, start, scale, enable_gqa)
    outs = []
    for first in range(0, n, rows):
        end = start + min(n, first + rows)
        outs.append(checkpoint(_attention_tile, q[:, :, first:first + rows], k[:, :, :end], v[:, :, :end], documents,
                               start + first, scale, enable_gqa, use_reentrant=False))
    return torch.cat(outs, dim=2)


def _attention_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None, start: int,
                    scale: float | None, enable_gqa: bool) -> torch.Tensor:
    keys = k.shape[2]
    if documents is None:
        positions = torch.arange(start, start + q.shape[2], device=q.device)
        mask = (torch.arange(keys, device=q.device)[None, :] <= positions[:, None])[None, None]
    else:
        mask = _tile_mask(documents, start, q.shape[2], keys)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _tile_mask(documents: torch.Tensor, start: int, queries: int, keys: int) -> torch.Tensor:
    """``(bs, 1, queries, keys)``: the queries at ``start`` onwards attend to the keys at or
    before them in their own document."""
    positions = torch.arange(start, start + queries, device=documents.device)
    causal = torch.arange(keys, device=documents.device)[None, :] <= positions[:, None]
    same = documents[:, start:start + queries, None] == documents[:, None, :keys]
    return (same & causal)[:, None]


@functools.cache
def compiled_block_mask() -> Any:
    """FlexAttention's ``create_block_mask``, compiled once: it evaluates the mask function block
    by block into the block tables, where uncompiled it first makes the dense ``(rows, queries,
    keys)`` boolean mask (8 GiB for one row of 92,681 tokens: quadratic in the sequence)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.cache
def compiled_flex_attention() -> Any:
    """FlexAttention, compiled once (uncompiled it materialises the whole score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class Decoder(nn.Module):
    """The decoder. ``forward(tokens)`` returns logits ``(bs, seq, vocab)``; with
    ``document_ids`` ``(bs, seq)`` (the packed documents of each row numbered) attention stays
    within each document and RoPE positions restart at each (block-causal)."""

    context_parallel: Any = None
    """A :class:`~torchtitan_lite.distributed.context_parallel.ContextParallel` when each rank holds
    a share of every sequence (:meth:`use_context_parallel`): ``forward`` then takes this rank's
    tokens and document ids (:meth:`ContextParallel.shard`)."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args=args),
            persistent=False,
        )

    sequence_shards: int = 1
    """Tensor parallel's sequence parallelism: the ranks the hidden states between blocks are
    split over along the sequence (:meth:`split_sequence_between_blocks`)."""

    pipeline_stages: dict[int, Any] | None = None
    """With pipeline parallel: this rank's stages by index (each a
    :class:`~torchtitan_lite.distributed.pipeline_parallel.StageLayout`), kept by
    :meth:`keep_stages`; ``forward(x, stage=i)`` runs stage ``i``."""

    # The parallelize steps change a decoder through these methods only (nothing outside this
    # module sets its attributes): each says what the forward then does differently.

    def use_context_parallel(self, context_parallel: Any) -> None:
        """Take a share of every sequence from here on (``context_parallel``, a
        :class:`~torchtitan_lite.distributed.context_parallel.ContextParallel`)."""
        self.context_parallel = context_parallel

    def split_sequence_between_blocks(self, shards: int) -> None:
        """Tensor parallel's sequence parallelism: the hidden states between blocks are split over
        ``shards`` ranks along the sequence (what a later pipeline stage takes)."""
        self.sequence_shards = shards

    def keep_stages(self, stages: Sequence[Any]) -> None:
        """Keep only the parts of ``stages`` (pipeline stage layouts with ``index``, ``layers``,
        ``first``, ``last``), built on the meta device: their blocks, the embedding with the
        first stage, the final norm and output projection with the last. Names are unchanged."""
        keep = {key for stage in stages for key in stage.layers}
        for key in list(self.layers.keys()):
            if key not in keep:
                del self.layers[key]
        if not any(stage.first for stage in stages):
            self.tok_embeddings = None
        if not any(stage.last for stage in stages):
            self.norm = None
            self.output = None
        self.pipeline_stages = {stage.index: stage for stage in stages}

    def adopt_parts(self, pruned: Decoder) -> None:
        """Take ``pruned``'s parts (a decoder after :meth:`keep_stages`) in place of this one's
        own: its blocks, and its embedding, norm and output where it has them."""
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(pruned, name) is not None:
                setattr(self, name, getattr(pruned, name))
        for key, block in pruned.layers.items():
            self.layers[key] = block
        if self.args.tie_word_embeddings:  # one weight: the pruned side's copy, on both sides
            if pruned.output is None and pruned.tok_embeddings is not None:
                self.output.weight = self.tok_embeddings.weight
            elif pruned.tok_embeddings is None and pruned.output is not None:
                self.tok_embeddings.weight = self.output.weight

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                stage: int | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens``; with ``stage`` (pipeline parallel) that stage's part only: from
        the tokens, or the hidden states of the stage before, to the logits, or the hidden states
        the next stage takes. With ``cache`` (generation): see :meth:`forward_cached`. ``labels``:
        handed to the output layer, for one that computes each label's loss in place of the logits
        (``training.tiled_loss``: the output layer tiled by the loss's ``tile_output``)."""
        if cache is not None:
            return self.forward_cached(tokens, cache)
        cp = self.context_parallel
        part = None if stage is None else self.pipeline_stages[stage]
        # (a later pipeline stage takes the hidden states, split over the sequence by tensor
        # parallel's sequence parallelism)
        positions = tokens.shape[1] * (1 if part is None or part.first else self.sequence_shards)
        seq_len = positions * (1 if cp is None else cp.degree)
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if part is None or part.first else tokens
        if cp is not None:  # this rank's share of each sequence: global positions, attention over all of it
            mask = cp.attention(positions, document_ids, tokens.device)
            rope = rope_bits(self.freqs_cis, self.freqs_cis.shape[0])[mask.positions]
        elif document_ids is None:
            rope, mask = rope_bits(self.freqs_cis, positions), None
        else:
            rope = rope_bits(self.freqs_cis, self.freqs_cis.shape[0])[document_positions(document_ids)]
            mask = block_causal_mask(document_ids)
        for layer in self.layers.values() if part is None else (self.layers[key] for key in part.layers):
            h = layer(h, rope, mask)
        if part is not None and not part.last:
            return h
        return self.output(self.norm(h)) if labels is None else self.output(self.norm(h), labels)

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One step of generation through ``cache`` (a :class:`KVCache`): ``tokens`` the
        ``(bs, prompt_len)`` left-padded prompts, then ``(bs, 1)``; the logits of each row's next
        token, ``(bs, 1, vocab)`` (split over the vocabulary under tensor parallel's loss parallel,
        as in training).

        A decode step's ``bs`` tokens run through the blocks as one sequence ``(1, bs)``: all but
        attention works per token, and :class:`CachedAttention` reads the rows back out. Under
        tensor parallel's sequence parallelism (:attr:`sequence_shards` ranks) the hidden states
        between blocks are then split over the ranks by rows, as a training sequence is by
        positions, so ``bs`` must be a multiple of :attr:`sequence_shards`, and so must
        ``prompt_len`` for the prefill. The prefill computes the logits of the last position only
        (under sequence parallelism: of each rank's last position, of which the sequence's last is
        kept)."""
        if self.context_parallel is not None or self.pipeline_stages is not None:
            raise ValueError("generation with a KV cache runs on the whole model: context parallel and pipeline "
                             "parallel are not supported")
        bs, seq_len = tokens.shape
        decoding = cache.length > 0
        if (bs if decoding else seq_len) % self.sequence_shards:
            what = f"{bs} rows" if decoding else f"{seq_len} prompt positions"
            raise ValueError(f"generation under sequence parallel: {what} is not a multiple of the "
                             f"{self.sequence_shards} ranks the sequence is split over")
        positions = cache.step(seq_len)
        # (a memory estimate's positions are fake tensors: shapes without values to check)
        if not isinstance(positions, FakeTensor) and int(positions.max()) >= self.freqs_cis.shape[0]:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len {self.args.max_seq_len}")
        if decoding:  # the rows as one sequence
            tokens, positions = tokens.reshape(1, bs), positions.reshape(1, bs)
        h = self.tok_embeddings(tokens)
        rope = rope_bits(self.freqs_cis, self.freqs_cis.shape[0])[positions]
        for key, layer in self.layers.items():
            h = layer(h, rope, cache.layer(key))
        if decoding:
            return self.output(self.norm(h)).transpose(0, 1)
        return self.output(self.norm(h[:, -1:]))[:, -1:]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer.

        Parameters are filled in place (sharded or not) from the global RNG, so the result
        depends only on the seed. ``buffer_device`` is where buffers are (re)built: the compute
        device, which differs from the parameters' device under CPU offload.
        """
        self.init_buffers(buffer_device)
        init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.init_weights()
        # The output projection's init; tied, it is also the embedding's (an embedding of std 1
        # would give logits of std sqrt(dim)).
        final_std = self.args.dim**-0.5
        init.trunc_normal_(self.output.weight, std=final_std, a=-3 * final_std, b=3 * final_std)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent RoPE table on ``buffer_device`` (default: where it is;
        CPU when that is the meta device): after ``to_empty`` and a load, which fill only
        parameters."""
        device = torch.device(buffer_device) if buffer_device is not None else self.freqs_cis.device
        if device.type == "meta":
            device = torch.device("cpu")
        self.freqs_cis = precompute_freqs_cis(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device, args=self.args
        )
        if self.args.num_experts:  # whether grouped products run here (read under compile)
            for dtype in (torch.float32, torch.bfloat16):
                grouped_mm_available(device.type, dtype)


def decoder_fsdp_units(model: nn.Module) -> FSDPLayout:
    """A :class:`Decoder`'s FSDP units: token embedding, each block, then final norm and output
    projection as one unit. With tied embeddings the embedding and the output projection (one
    parameter) join the final norm in the last unit: it is gathered for the embedding, stays
    gathered until the output projection has run (FSDP2 frees a unit after all its modules'
    forwards), and as the last unit is not freed before backward, which needs it at once. (A
    pipeline rank holding only one of the two has its copy of the weight in its own unit.)"""
    assert isinstance(model, Decoder)
    blocks = list(model.layers.values())
    if model.args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        return FSDPLayout(blocks=blocks, last_unit=[model.norm, model.output, model.tok_embeddings])
    # (a pipeline stage may hold no embedding, or no norm and output)
    return FSDPLayout(first_unit=model.tok_embeddings, blocks=blocks,
                      last_unit=None if model.norm is None else [model.norm, model.output])
