"""DeepSeek-V3's multi-head latent attention (MLA) and its YaRN RoPE.

MLA compresses what attention reads. The queries go through a low-rank bottleneck
(``wq_a``: dim → ``q_lora_rank``, an RMSNorm ``q_norm``, then ``wq_b`` to every head's
``qk_nope_head_dim + qk_rope_head_dim``), or, when ``q_lora_rank`` is 0 (DeepSeek-V2-Lite), through
one plain projection ``wq``. The keys and values come from one latent: ``wkv_a`` maps the input to
``kv_lora_rank`` latent dimensions plus ``qk_rope_head_dim`` dimensions of a *single* rotary key
shared by every head; the latent is normalised (``kv_norm``) and expanded by ``wkv_b`` into each
head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``). Each head's key is its
non-rotary part followed by the shared rotary part, its query likewise, so the query/key head
dim (``qk_nope_head_dim + qk_rope_head_dim``) differs from the value head dim, which
``scaled_dot_product_attention`` and FlexAttention accept. Only the ``qk_rope_head_dim`` parts
are rotated: the RoPE table the blocks receive is built for that head dim (the family's args
give ``head_dim`` = ``qk_rope_head_dim``, what the decoder builds its table for).

RoPE layout: :func:`~torchtitan_lite.models.decoder.apply_rotary_emb` rotates interleaved pairs
``(x[2i], x[2i+1])``. DeepSeek's checkpoints store the rotary dims that way too (transformers'
``rope_interleave=True``, the default for DeepSeek-V3, rotates the even/odd slices and writes
them out de-interleaved, as ``[rotated evens, rotated odds]``; queries and keys both, so their dot
products are those of our interleaved rotation), so the projections load with no permutation.

YaRN (``rope_scaling == "yarn"``, as in transformers' ``_compute_yarn_parameters``) does three
things, handled as follows:

* the frequencies are blended between extrapolated (``inv_freq``) and interpolated
  (``inv_freq / factor``) by a ramp over the pairs: :func:`yarn_inv_freq`, which the args' method
  ``scale_rope_frequencies`` calls, so the decoder's generic ``precompute_freqs_cis`` builds the
  table unchanged (unit-magnitude rotations);
* transformers multiplies cos and sin by an ``attention_factor`` (:func:`yarn_attention_factor`:
  ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``, which is 1 for
  DeepSeek-V3's ``mscale == mscale_all_dim``). Both the query's and the key's rotary parts get
  it, so it scales the rotary part of every score by ``attention_factor²``: :class:`MLAttention`
  multiplies the shared single-head rotary key by ``attention_factor²`` (the smallest tensor it
  could put it on), and skips that when the factor is 1. The table stays a pure rotation, and so
  is exactly what ``precompute_freqs_cis``/``rope_bits`` produce for every family;
* the softmax scale is ``qk_head_dim ** -0.5`` times ``yarn_get_mscale(factor, mscale_all_dim)²``
  when ``mscale_all_dim`` is set (nonzero): :func:`yarn_softmax_scale`.

:func:`yarn_parameters` gives the last two from the args. Parameters are created empty and
filled by :meth:`MLAttention.init_weights`, as in :mod:`torchtitan_lite.models.decoder`.

Generation: with a :class:`~torchtitan_lite.models.kv_cache.KVCache`, the mask :class:`MLAttention`
receives is a :class:`~torchtitan_lite.models.decoder.CachedAttention`, and :func:`attend` caches each
head's expanded key (``qk_nope_head_dim + qk_rope_head_dim``, the shared rotary part repeated) and
value (``v_head_dim``): the forward is the training one, step for step. (DeepSeek's inference code
can cache the latent instead, ``kv_lora_rank + qk_rope_head_dim`` a token, absorbing ``wkv_b`` into
the query and output; that is a smaller cache, not implemented here.)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

import torchtitan_lite.models.init as init
from torchtitan_lite.models.decoder import RMSNorm, apply_rotary_emb, attend

__all__ = ["LATENT_NORM_EPS", "MLAttention", "MLA_HF_NAMES", "YarnParameters",
           "mla_hf_shapes", "yarn_attention_factor", "yarn_get_mscale", "yarn_inv_freq", "yarn_parameters",
           "yarn_softmax_scale"]

LATENT_NORM_EPS = 1e-6
"""The epsilon of the RMSNorms over the query and key/value latents (``q_norm``, ``kv_norm``):
DeepSeek's reference code and transformers' ``DeepseekV3Attention`` build them with the RMSNorm's
default 1e-6 whatever ``rms_norm_eps`` says (Moonlight's is 1e-5)."""

MLA_HF_NAMES: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
"""Our per-layer parameter suffix (under ``layers.<i>.``) → Hugging Face's (under
``model.layers.<i>.``). ``wq`` exists only when ``q_lora_rank`` is 0, ``wq_a``/``q_norm``/``wq_b``
only otherwise. Same (out, in) layout on both sides: no permutation."""


def mla_hf_shapes(args: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face's per-layer attention suffix → its shape, for these args (only the
    parameters that exist: ``q_proj`` or the ``q_a``/``q_b`` pair)."""
    qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if args.q_lora_rank:
        shapes["self_attn.q_a_proj.weight"] = (args.q_lora_rank, args.dim)
        shapes["self_attn.q_a_layernorm.weight"] = (args.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (args.n_heads * qk_head_dim, args.q_lora_rank)
    else:
        shapes["self_attn.q_proj.weight"] = (args.n_heads * qk_head_dim, args.dim)
    shapes["self_attn.kv_a_proj_with_mqa.weight"] = (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)
    shapes["self_attn.kv_a_layernorm.weight"] = (args.kv_lora_rank,)
    shapes["self_attn.kv_b_proj.weight"] = (
        args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank
    )
    shapes["self_attn.o_proj.weight"] = (args.dim, args.n_heads * args.v_head_dim)
    return shapes


# --- YaRN --------------------------------------------------------------------------------------


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """The factor transformers multiplies YaRN's cos and sin by: ``attention_factor`` when given,
    else ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are set
    (nonzero), else ``get_mscale(factor)``."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float | None) -> float:
    """MLA's softmax scale under YaRN: ``qk_head_dim ** -0.5``, times
    ``get_mscale(factor, mscale_all_dim)²`` when ``mscale_all_dim`` is set (nonzero)."""
    scale = qk_head_dim**-0.5
    if mscale_all_dim:
        mscale = yarn_get_mscale(factor, mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def yarn_inv_freq(
    inv_freq: torch.Tensor, *, theta: float, factor: float, original_max_seq_len: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
) -> torch.Tensor:
    """YaRN's frequencies from the unscaled ``inv_freq`` (``theta ** (-2i / dim)``, one per pair).

    A pair that turns more than ``beta_fast`` times over ``original_max_seq_len`` positions keeps
    its frequency (extrapolation), one that turns fewer than ``beta_slow`` times is divided by
    ``factor`` (interpolation), with a linear ramp over the pair index between. The bounds are
    floored/ceiled when ``truncate`` (transformers' default) and clipped to ``[0, dim - 1]``.
    Computed in ``inv_freq``'s dtype (transformers uses float32).
    """
    dim = 2 * inv_freq.shape[-1]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_seq_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    index = torch.arange(dim // 2, device=inv_freq.device, dtype=inv_freq.dtype)
    ramp = ((index - low) / (high - low)).clamp(0, 1)  # 0: extrapolate, 1: interpolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class YarnParameters(NamedTuple):
    attention_factor: float
    """The magnitude of transformers' YaRN cos/sin (1 without YaRN): each score's rotary part
    is multiplied by its square."""
    softmax_scale: float
    """The scale of the query-key scores before the softmax."""


def yarn_parameters(args: Any) -> YarnParameters:
    """The rotary magnitude and softmax scale of MLA with these args: ``rope_scaling``
    (``"none"`` or ``"yarn"``), ``rope_factor``, ``mscale``, ``mscale_all_dim``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and optionally ``attention_factor`` (an explicit
    override, as transformers' ``rope_parameters["attention_factor"]``; ``None`` or absent:
    derived from the mscales)."""
    qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
    if args.rope_scaling == "none":
        return YarnParameters(1.0, qk_head_dim**-0.5)
    if args.rope_scaling != "yarn":
        raise ValueError(f"rope_scaling {args.rope_scaling!r} is not 'none' or 'yarn'")
    factor = args.rope_factor
    return YarnParameters(
        yarn_attention_factor(factor, args.mscale, args.mscale_all_dim, getattr(args, "attention_factor", None)),
        yarn_softmax_scale(qk_head_dim, factor, args.mscale_all_dim),
    )


class MLAttention(nn.Module):
    """Multi-head latent attention; ``forward(x, freqs_cis, mask)`` as the decoder's ``Attention``
    (``freqs_cis``: the decoder's table for ``qk_rope_head_dim``, in ``rope_bits`` form or per
    sample and position; ``mask``: whatever :func:`attend` takes, a generation's cache included)."""

    tensor_parallel_columns = ("wq", "wq_b", "wkv_b")
    """The linears whose output features are heads (split over tensor-parallel ranks)."""
    tensor_parallel_rows = ("wo",)
    tensor_parallel_whole = ("wq_a", "q_norm", "wkv_a", "kv_norm")
    """What runs whole on every tensor-parallel rank: the latent down-projections and their norms."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        # Under tensor parallel each rank computes some heads, and the rotary key every head
        # shares gets its gradient from this rank's heads only: this sums it over the ranks
        # (identity in forward). None: every head is here.
        self.shared_key_grad: Any = None
        self.q_lora_rank = args.q_lora_rank or 0
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, args.dim, bias=False)
        yarn = yarn_parameters(args)
        self.softmax_scale = yarn.softmax_scale
        # Each score's rotary part, q_pe·k_pe, carries the YaRN cos/sin magnitude twice.
        self.rope_score_factor = yarn.attention_factor**2

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        # (-1: the heads this rank computes, all of them but under tensor parallel)
        q_nope, q_pe = q.view(bs, seq_len, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)

        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)  # (bs, seq, 1, rope): shared by the heads
        if self.rope_score_factor != 1.0:
            k_pe = k_pe * self.rope_score_factor
        if self.shared_key_grad is not None:
            k_pe = self.shared_key_grad(k_pe)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = attend(q, k, v, mask, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))

    def init_weights(self, out_std: float) -> None:
        """TorchTitan's MLA init: the input-side projections truncated normal (std 0.02), the
        output projection std ``out_std``, the norms ones."""
        if self.q_lora_rank == 0:
            init.trunc_normal_(self.wq.weight, std=0.02)
        else:
            init.trunc_normal_(self.wq_a.weight, std=0.02)
            init.trunc_normal_(self.wq_b.weight, std=0.02)
            self.q_norm.init_weights()
        init.trunc_normal_(self.wkv_a.weight, std=0.02)
        init.trunc_normal_(self.wkv_b.weight, std=0.02)
        self.kv_norm.init_weights()
        init.trunc_normal_(self.wo.weight, std=out_std)
