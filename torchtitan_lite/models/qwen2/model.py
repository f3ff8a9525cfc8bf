"""Qwen2 / Qwen2.5 dense shapes: :class:`Qwen2Args` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` with biases on the query, key and value
projections, an explicit feed-forward width and, in the small sizes, tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_lite.models.decoder import Decoder

__all__ = ["QWEN2_FLAVORS", "Qwen2", "Qwen2Args"]

Qwen2 = Decoder
"""The Qwen2 model: the shared decoder with q/k/v biases."""


@dataclass(frozen=True)
class Qwen2Args:
    """Shape of a Qwen2 / Qwen2.5 dense model."""

    dim: int = 896
    n_layers: int = 24
    n_heads: int = 14
    n_kv_heads: int = 2
    ffn_hidden_dim: int = 4864
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 32768
    tie_word_embeddings: bool = True
    depth_init: bool = True

    qk_norm = False  # (class constants: Qwen2 has q/k/v biases and no q/k norms)
    qkv_bias = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim} does not split into {self.n_heads} heads of even size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count (a tied embedding counts once, as the output projection)."""
        d, h, kv = self.dim, self.ffn_hidden_dim, self.n_kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * kv + (d + 2 * kv) + 3 * d * h + 2 * d
        total = self.n_layers * block + d + d * self.vocab_size
        if include_embedding and not self.tie_word_embeddings:
            total += self.vocab_size * d
        return total

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of one layer's attention matmuls."""
        return 12 * self.dim * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 × non-embedding params plus the attention matmuls."""
        return 6 * self.num_params(include_embedding=False) + self.n_layers * self.attention_flops_per_token(seq_len)

    def scale_rope_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Unscaled RoPE."""
        return inv_freq


QWEN2_FLAVORS: dict[str, Qwen2Args] = {
    "tiny": Qwen2Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=258,
                      rope_theta=10000.0, max_seq_len=512),
    # Qwen2.5 dense sizes.
    "0.5B": Qwen2Args(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden_dim=4864),
    "1.5B": Qwen2Args(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_hidden_dim=8960),
    "3B": Qwen2Args(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_hidden_dim=11008),
    "7B": Qwen2Args(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, vocab_size=152064,
                    tie_word_embeddings=False),
    "14B": Qwen2Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_dim=13824, vocab_size=152064,
                     tie_word_embeddings=False),
    "32B": Qwen2Args(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648, vocab_size=152064,
                     tie_word_embeddings=False),
    "72B": Qwen2Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=29568, vocab_size=152064,
                     tie_word_embeddings=False),
}
