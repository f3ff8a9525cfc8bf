"""A Llama-3-style decoder-only Transformer.

RMSNorm, rotary position embeddings (interleaved pairs, as in Meta's Llama reference; the
rotations live in a non-persistent complex buffer and reach the blocks as :func:`rope_bits`;
Llama 3.1's frequency scaling and linear scaling optional), grouped-query attention through
``scaled_dot_product_attention``, a SwiGLU feed-forward, and optionally an output projection tied
to the token embedding (Llama 3.2 1B and 3B). Parameter names follow the Llama-3
checkpoint convention. Nothing here knows about FSDP: the model can be built on the meta device,
sharded by :mod:`torchtitan_lite.distributed.fsdp`, materialised with ``to_empty`` and then filled by
:meth:`Transformer.init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torchtitan_lite.models.init as init

__all__ = ["LLAMA3_FLAVORS", "ROPE_SCALINGS", "ModelArgs", "Transformer", "apply_rotary_emb", "precompute_freqs_cis",
           "rope_bits", "scale_rope_frequencies"]


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama-3-style model."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    depth_init: bool = True
    rope_scaling: str = "none"
    """RoPE frequency scaling: ``"none"``; ``"llama3"`` (Llama 3.1+: low frequencies divided by
    ``rope_scaling_factor``, high ones kept, a smooth blend between, set by the two frequency
    factors and ``rope_original_max_seq_len``); ``"linear"`` (every frequency divided by the
    factor, i.e. positions interpolated)."""
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_word_embeddings: bool = False
    """The output projection is the token embedding's weight (one parameter)."""

    def __post_init__(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling != "none" and self.rope_scaling_factor <= 0:
            raise ValueError(f"rope_scaling_factor {self.rope_scaling_factor} must be > 0")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"rope_high_freq_factor {self.rope_high_freq_factor} must be above "
                             f"rope_low_freq_factor {self.rope_low_freq_factor}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count of :class:`Transformer` with these args (a tied embedding
        counts once: as the output projection, which is not an embedding-only parameter)."""
        d, h = self.dim, self.ffn_hidden_dim
        attn = d * d * 2 + 2 * d * self.kv_heads * self.head_dim
        block = attn + 3 * d * h + 2 * d
        total = self.n_layers * block + d + d * self.vocab_size
        if include_embedding and not self.tie_word_embeddings:
            total += self.vocab_size * d
        return total

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of one layer's attention matmuls (scores and weighted
        values; forward 4 × dim × seq_len, backward twice that)."""
        return 12 * self.dim * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 × non-embedding params plus the attention matmuls."""
        dense = 6 * self.num_params(include_embedding=False)
        return dense + self.n_layers * self.attention_flops_per_token(seq_len)


ROPE_SCALINGS = ("none", "llama3", "linear")

# Llama 3.1 and later: 128K context from an 8K-trained base.
_LLAMA31_ROPE = {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0,
                 "rope_high_freq_factor": 4.0, "rope_original_max_seq_len": 8192, "max_seq_len": 131072}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # Small enough for unit tests: GQA (4 query heads share 2 kv heads).
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258,
                      multiple_of=32, rope_theta=10000.0, max_seq_len=512),
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=258,
                            rope_theta=500000.0, max_seq_len=2048),
    # Llama-3.2-1B shape (untied embeddings).
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                    multiple_of=256, rope_theta=500000.0),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, rope_theta=500000.0),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, rope_theta=500000.0),
    # The published Llama 3.1 / 3.2 / 3.3 shapes (3.3 70B is 3.1 70B's shape).
    "3.1-8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                        multiple_of=1024, rope_theta=500000.0, **_LLAMA31_ROPE),
    "3.1-70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                         multiple_of=4096, rope_theta=500000.0, **_LLAMA31_ROPE),
    "3.1-405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                          multiple_of=4096, rope_theta=500000.0, **_LLAMA31_ROPE),
    "3.2-1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                        multiple_of=256, rope_theta=500000.0, tie_word_embeddings=True, **_LLAMA32_ROPE),
    "3.2-3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                        multiple_of=256, rope_theta=500000.0, tie_word_embeddings=True, **_LLAMA32_ROPE),
}


def scale_rope_frequencies(inv_freq: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """``inv_freq`` (radians per position, one per rotated pair) after ``args.rope_scaling``.

    ``llama3``: a frequency whose wavelength is longer than ``original / low_freq_factor``
    positions is divided by the factor, one shorter than ``original / high_freq_factor`` is
    kept, and those between are blended linearly in ``original / wavelength``. ``linear``:
    every frequency is divided by the factor."""
    if args.rope_scaling == "none":
        return inv_freq
    factor = args.rope_scaling_factor
    if args.rope_scaling == "linear":
        return inv_freq / factor
    low, high, original = args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, blended))


def precompute_freqs_cis(
    head_dim: int, max_seq_len: int, theta: float, *, device: torch.device | str | None = None,
    args: ModelArgs | None = None,
) -> torch.Tensor:
    """Return the ``(max_seq_len, head_dim // 2)`` complex64 rotations ``exp(i · pos · freq)``,
    the frequencies scaled as ``args.rope_scaling`` says (:func:`scale_rope_frequencies`).

    Kept complex (the buffer is not a floating-point tensor, so nothing casts it); the blocks
    get it as :func:`rope_bits`.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    )
    if args is not None:
        inv_freq = scale_rope_frequencies(inv_freq, args)
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

    The product with ``exp(i·θ)`` is written with real cos/sin arithmetic (the same values as a
    complex multiply, bit for bit on CPU): inductor generates code for it, which it does not for
    complex operators.
    """
    seq_len, head_dim = x.shape[1], x.shape[-1]
    table = freqs_cis.view(torch.float32) if freqs_cis.dtype == torch.int32 else torch.view_as_real(freqs_cis)
    table = table[:seq_len].view(1, seq_len, 1, head_dim // 2, 2)
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
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        q = self.wq(x).view(bs, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seq_len, self.n_kv_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std=0.02)
        init.trunc_normal_(self.wo.weight, std=out_std)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        init.trunc_normal_(self.w1.weight, std=0.02)
        init.trunc_normal_(self.w2.weight, std=out_std)
        init.trunc_normal_(self.w3.weight, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class Transformer(nn.Module):
    """Llama-3 decoder. ``forward(tokens)`` returns logits ``(bs, seq, vocab)``."""

    def __init__(self, args: ModelArgs) -> None:
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.args.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        rope = rope_bits(self.freqs_cis, tokens.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))

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
            layer.init_weights()  # type: ignore[operator]
        self.norm.init_weights()
        if not self.args.tie_word_embeddings:  # tied: the embedding's values serve both
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
