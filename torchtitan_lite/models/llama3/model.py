"""Llama 3 shapes: :class:`ModelArgs` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` (RMSNorm, interleaved-pair RoPE with Llama
3.1's frequency scaling or linear scaling, grouped-query attention, SwiGLU, an output projection
optionally tied to the token embedding as in Llama 3.2 1B and 3B). Parameter names follow the Llama-3
checkpoint convention. Nothing here knows about FSDP: the model can be built on the meta device,
sharded by :mod:`torchtitan_lite.distributed.fsdp`, materialised with ``to_empty`` and then filled by
:meth:`Transformer.init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchtitan_lite.models.decoder import Decoder, apply_rotary_emb, precompute_freqs_cis, rope_bits
from torchtitan_lite.models.spec import DecoderArgs

Transformer = Decoder
"""The Llama model: the shared decoder (``Transformer`` is the name Llama code uses)."""

__all__ = ["LLAMA3_FLAVORS", "ROPE_SCALINGS", "ModelArgs", "Transformer", "apply_rotary_emb", "precompute_freqs_cis",
           "rope_bits"]


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
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

    qk_norm = False  # (class constants: Llama has neither q/k norms nor q/k/v biases)
    qkv_bias = False

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

    def scale_rope_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` (radians per position, one per rotated pair) after ``rope_scaling``.

        ``llama3``: a frequency whose wavelength is longer than ``original / low_freq_factor``
        positions is divided by the factor, one shorter than ``original / high_freq_factor`` is
        kept, and those between are blended linearly in ``original / wavelength``. ``linear``:
        every frequency is divided by the factor."""
        if self.rope_scaling == "none":
            return inv_freq
        factor = self.rope_scaling_factor
        if self.rope_scaling == "linear":
            return inv_freq / factor
        low, high, original = self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelen > original / low, inv_freq / factor,
                           torch.where(wavelen < original / high, inv_freq, blended))

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
    # TorchTitan's 405B (its train_configs/llama3_405b.toml): Llama 3.1 405B's shape, no rope scaling.
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
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
