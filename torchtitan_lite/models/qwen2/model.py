"""Qwen2 / Qwen2.5 dense shapes: :class:`Qwen2Args` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` with biases on the query, key and value
projections, an explicit feed-forward width and, in the small sizes, tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.qwen3.model import QwenArgs

__all__ = ["QWEN2_FLAVORS", "Qwen2", "Qwen2Args"]

Qwen2 = Decoder
"""The Qwen2 model: the shared decoder with q/k/v biases."""


@dataclass(frozen=True)
class Qwen2Args(QwenArgs):
    """Shape of a Qwen2 / Qwen2.5 dense model (head size ``dim / n_heads``)."""

    qk_norm = False  # (class constants: Qwen2 has q/k/v biases and no q/k norms)
    qkv_bias = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} does not split into {self.n_heads} heads")
        super().__post_init__()


_QWEN25 = {"max_seq_len": 32768}
QWEN2_FLAVORS: dict[str, Qwen2Args] = {
    "tiny": Qwen2Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=258,
                      rope_theta=10000.0, max_seq_len=512),
    # Qwen2.5 dense sizes.
    "0.5B": Qwen2Args(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden_dim=4864, **_QWEN25),
    "1.5B": Qwen2Args(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_hidden_dim=8960, **_QWEN25),
    "3B": Qwen2Args(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_hidden_dim=11008, **_QWEN25),
    "7B": Qwen2Args(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, vocab_size=152064,
                    tie_word_embeddings=False, **_QWEN25),
    "14B": Qwen2Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_dim=13824, vocab_size=152064,
                     tie_word_embeddings=False, **_QWEN25),
    "32B": Qwen2Args(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648, vocab_size=152064,
                     tie_word_embeddings=False, **_QWEN25),
    "72B": Qwen2Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=29568, vocab_size=152064,
                     tie_word_embeddings=False, **_QWEN25),
}
