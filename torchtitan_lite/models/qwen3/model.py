"""Qwen3 dense shapes: :class:`Qwen3Args` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` with an RMSNorm over each head's queries and keys
before RoPE, a head size of its own (not ``dim / n_heads``), an explicit feed-forward width and,
in the small sizes, the output projection tied to the token embedding. :class:`QwenArgs` holds
what Qwen3 and Qwen2 (:mod:`torchtitan_lite.models.qwen2`) shapes share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.spec import DecoderArgs

__all__ = ["QWEN3_FLAVORS", "Qwen3", "Qwen3Args", "QwenArgs"]

Qwen3 = Decoder
"""The Qwen3 model: the shared decoder with q/k norms."""


@dataclass(frozen=True)
class QwenArgs(DecoderArgs):
    """Fields and counts a Qwen shape shares; a family sets ``head_dim`` and the class constants
    ``qk_norm`` (q/k RMSNorms) and ``qkv_bias`` (q/k/v biases)."""

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    ffn_hidden_dim: int = 3072
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_word_embeddings: bool = True
    depth_init: bool = True

    qk_norm = False
    qkv_bias = False
    # head_dim: a field (Qwen3) or a property (Qwen2) of each family

    def __post_init__(self) -> None:
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count (a tied embedding counts once, as the output projection)."""
        d, h, q, kv = self.dim, self.ffn_hidden_dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block = 2 * d * q + 2 * d * kv + 3 * d * h + 2 * d
        block += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        total = self.n_layers * block + d + d * self.vocab_size
        if include_embedding and not self.tie_word_embeddings:
            total += self.vocab_size * d
        return total

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of one layer's attention matmuls (forward 4 × query width ×
        seq_len, backward twice that)."""
        return 12 * self.n_heads * self.head_dim * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 × non-embedding params plus the attention matmuls."""
        return 6 * self.num_params(include_embedding=False) + self.n_layers * self.attention_flops_per_token(seq_len)

    def scale_rope_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Unscaled RoPE."""
        return inv_freq


@dataclass(frozen=True)
class Qwen3Args(QwenArgs):
    """Shape of a Qwen3 dense model."""

    head_dim: int = 128

    qk_norm = True  # (class constants: every Qwen3 attention normalises q and k; no biases)
    qkv_bias = False


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # Small enough for unit tests; head_dim 32 is not dim / n_heads (16), as in the real sizes.
    "tiny": Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128,
                      vocab_size=258, rope_theta=10000.0, max_seq_len=512),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288, tie_word_embeddings=False),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408, tie_word_embeddings=False),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600, tie_word_embeddings=False),
}
