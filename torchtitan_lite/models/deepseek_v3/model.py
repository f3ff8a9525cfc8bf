"""DeepSeek-V3 shapes: :class:`DeepseekV3Args` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` with DeepSeek's multi-head latent attention
(:class:`~torchtitan_lite.models.deepseek_v3.attention.MLAttention`, optionally with YaRN RoPE)
in every block, a dense SwiGLU feed-forward in the first ``first_k_dense_replace`` blocks and a
mixture of experts (:class:`~torchtitan_lite.models.moe.MoE`) in the others: a sigmoid router
with a per-expert balancing bias (transformers' ``e_score_correction_bias``, which chooses the
experts but does not weight them), group-limited top-k (``n_group``/``topk_group``), the chosen
scores renormalised and scaled by ``route_scale``, plus ``n_shared_experts`` shared experts, as
in ``transformers``' ``DeepseekV3ForCausalLM``. The multi-token-prediction module of the
published checkpoints is not part of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.deepseek_v3.attention import MLAttention, yarn_inv_freq
from torchtitan_lite.models.moe import MoEParams, router_problem

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepseekV3", "DeepseekV3Args"]

DeepseekV3 = Decoder
"""The DeepSeek-V3 model: the shared decoder with latent attention and MoE feed-forwards."""


class _DenseMLAShape:
    """Counts of the model with every feed-forward dense (what :class:`MoEParams` corrects)."""

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count with every block's feed-forward dense (``ffn_hidden_dim``): the
        latent attention's projections and norms, the feed-forward, the block norms, the final
        norm and the output projection (a tied embedding counts once, as the output projection)."""
        a: DeepseekV3Args = self
        d, heads = a.dim, a.n_heads
        if a.q_lora_rank:
            query = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * a.qk_head_dim
        else:
            query = d * heads * a.qk_head_dim
        latent = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        expand = a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
        attention = query + latent + expand + heads * a.v_head_dim * d
        block = attention + 3 * d * a.ffn_hidden_dim + 2 * d
        total = a.n_layers * block + d + d * a.vocab_size
        if include_embedding and not a.tie_word_embeddings:
            total += a.vocab_size * d
        return total

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of one layer's attention matmuls, counted as the other
        families count theirs (every key of the sequence, no causal discount): forward, per head,
        ``2 · qk_head_dim · seq_len`` for the scores and ``2 · v_head_dim · seq_len`` for the
        weighted values; backward twice that. That is ``12 · n_heads · (qk_head_dim +
        v_head_dim) / 2 · seq_len``, exact for MLA as computed here (keys and values expanded per
        head; the latent projections are parameters, counted in ``6 × active params``)."""
        a: DeepseekV3Args = self
        return 6 * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len


@dataclass(frozen=True)
class DeepseekV3Args(MoEParams, _DenseMLAShape):
    """Shape of a DeepSeek-V3 model. Defaults: DeepSeek-V3's published sizes with
    ``transformers``' defaults for the rest (no RoPE scaling, 4096 positions); the "671B" flavor
    adds its YaRN."""

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    ffn_hidden_dim: int = 18432
    """The dense blocks' feed-forward width (transformers' ``intermediate_size``)."""
    norm_eps: float = 1e-6
    """The blocks' RMSNorms (the latent norms of the attention always use 1e-6, as transformers)."""
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    depth_init: bool = True

    # Multi-head latent attention
    q_lora_rank: int = 1536
    """The query bottleneck's width; 0: one plain query projection (transformers' ``None``)."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # RoPE (over the qk_rope_head_dim dims): "none" or "yarn" with its settings
    rope_scaling: str = "none"
    rope_factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    """0: unset (transformers' ``None``)."""
    mscale_all_dim: float = 1.0
    """0: unset (transformers' ``None``): no softmax-scale correction."""
    rope_truncate: bool = True
    """Floor/ceil YaRN's ramp bounds (transformers' ``rope_parameters["truncate"]``)."""
    rope_interleave: bool = True
    """How Hugging Face files lay out the rotary rows of the query and latent projections:
    interleaved pairs, as ours (DeepSeek's checkpoints), or halves (transformers'
    ``rope_interleave: false``; the rows are permuted on import and export). The model computes
    the same either way."""

    # Mixture of experts
    num_experts: int = 256
    top_k: int = 8
    moe_hidden_dim: int = 2048
    n_shared_experts: int = 1
    first_k_dense_replace: int = 3
    """The first blocks with a dense feed-forward; every later block is a mixture of experts."""
    norm_topk_prob: bool = True
    route_scale: float = 2.5
    """The chosen experts' weights are multiplied by it (transformers' ``routed_scaling_factor``)."""
    n_group: int = 8
    topk_group: int = 4
    score_func: str = "sigmoid"
    router_aux_loss_coef: float = 0.0
    """The load-balancing loss's weight in the training loss (``moe.aux_loss_coef`` overrides it):
    0, DeepSeek-V3 balances its experts with the router bias instead (``moe.bias_update_rate``)."""

    qk_norm = False  # (class constants: the decoder's q/k norms and q/k/v biases are not used)
    qkv_bias = False
    attention_cls: ClassVar[type] = MLAttention

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden_dim", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_hidden_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)} must be positive")
        for name in ("q_lora_rank", "n_shared_experts", "first_k_dense_replace"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must be 0 or more")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for RoPE")
        if self.rope_scaling not in ("none", "yarn"):
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not 'none' or 'yarn'")
        if self.rope_scaling == "yarn" and (self.rope_factor <= 0 or self.original_max_seq_len <= 0):
            raise ValueError(f"YaRN needs rope_factor > 0 and original_max_seq_len > 0, got {self.rope_factor} "
                             f"and {self.original_max_seq_len}")
        problem = router_problem(self.num_experts, self.top_k, self.score_func, self.n_group, self.topk_group)
        if problem is not None:
            raise ValueError(problem)

    @property
    def qk_head_dim(self) -> int:
        """Each head's query/key width: its non-rotary and rotary parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The RoPE table's head dim: only the ``qk_rope_head_dim`` dims are rotated (as
        transformers 5's ``config.head_dim``)."""
        return self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """Every head has its own keys and values (expanded from the shared latent)."""
        return self.n_heads

    @property
    def shared_hidden_dim(self) -> int:
        """The shared experts' width, run as one SwiGLU (as transformers)."""
        return self.n_shared_experts * self.moe_hidden_dim

    def moe_layer(self, layer_id: int) -> bool:
        """As ``transformers`` (``moe_layer_freq`` 1): every block from ``first_k_dense_replace`` on."""
        return layer_id >= self.first_k_dense_replace

    def scale_rope_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` after YaRN's blend (:func:`~.attention.yarn_inv_freq`); unchanged without scaling."""
        if self.rope_scaling == "none":
            return inv_freq
        return yarn_inv_freq(inv_freq, theta=self.rope_theta, factor=self.rope_factor,
                             original_max_seq_len=self.original_max_seq_len, beta_fast=self.beta_fast,
                             beta_slow=self.beta_slow, truncate=self.rope_truncate)


DEEPSEEK_V3_FLAVORS: dict[str, DeepseekV3Args] = {
    # Small enough for unit tests: 8 experts in 2 groups, top-2 from 1 group, a shared expert,
    # the first block dense, the query bottleneck on.
    "tiny": DeepseekV3Args(dim=64, n_layers=3, n_heads=4, vocab_size=258, ffn_hidden_dim=128, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
                           top_k=2, moe_hidden_dim=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                           topk_group=1, max_seq_len=512),
    # Moonlight-16B-A3B's published config.json (moonshotai; DeepseekV3ForCausalLM): no query
    # bottleneck, 64 experts (top-6) in one group, 2 shared, rms_norm_eps 1e-5, no RoPE scaling.
    "16B": DeepseekV3Args(dim=2048, n_layers=27, n_heads=16, vocab_size=163840, ffn_hidden_dim=11264,
                          norm_eps=1e-5, rope_theta=50000.0, max_seq_len=8192, q_lora_rank=0, kv_lora_rank=512,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=64, top_k=6,
                          moe_hidden_dim=1408, n_shared_experts=2, first_k_dense_replace=1, route_scale=2.446,
                          n_group=1, topk_group=1),
    # DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3; its weights are fp8 blocks:
    # dequantize to bf16 before importing), without its multi-token-prediction layer.
    "671B": DeepseekV3Args(max_seq_len=163840, rope_scaling="yarn", rope_factor=40.0, original_max_seq_len=4096,
                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
}
