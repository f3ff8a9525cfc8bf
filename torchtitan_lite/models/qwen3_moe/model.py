"""Qwen3-MoE shapes: :class:`Qwen3MoeArgs` and the named flavors. The model is the shared
:class:`~torchtitan_lite.models.decoder.Decoder` (Qwen3's attention with q/k norms and its own
head size) whose feed-forward layers are mixtures of experts
(:class:`~torchtitan_lite.models.moe.MoE`, a softmax router) except the layers
``mlp_only_layers`` names or ``decoder_sparse_step`` skips, as in ``transformers``'
``Qwen3MoeForCausalLM``."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.models.decoder import Decoder
from torchtitan_lite.models.moe import MoEParams, router_problem
from torchtitan_lite.models.qwen3.model import Qwen3Args

__all__ = ["QWEN3_MOE_FLAVORS", "Qwen3Moe", "Qwen3MoeArgs"]

Qwen3Moe = Decoder
"""The Qwen3-MoE model: the shared decoder with MoE feed-forwards."""


@dataclass(frozen=True)
class Qwen3MoeArgs(MoEParams, Qwen3Args):
    """Shape of a Qwen3-MoE model: Qwen3's fields (``ffn_hidden_dim`` is the width of the dense
    layers, if any) and the experts'."""

    num_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    """The load-balancing loss's weight in the training loss (``moe.aux_loss_coef`` overrides it)."""
    score_func: str = "softmax"

    # Not in Qwen3-MoE: DeepSeek's router groups, routed scaling and shared experts.
    n_group = 1
    topk_group = 1
    route_scale = 1.0
    shared_hidden_dim = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        problem = router_problem(self.num_experts, self.top_k, self.score_func, self.n_group, self.topk_group)
        if problem is not None:
            raise ValueError(problem)
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be at least 1")

    def moe_layer(self, layer_id: int) -> bool:
        """As ``transformers``: an MoE layer unless ``mlp_only_layers`` names it or it is not a
        multiple of ``decoder_sparse_step`` (counting from 1)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    # Small enough for unit tests: 8 experts, top-2; head_dim 32 is not dim / n_heads (16).
    "tiny": Qwen3MoeArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128,
                         moe_hidden_dim=32, num_experts=8, top_k=2, vocab_size=258, rope_theta=10000.0,
                         max_seq_len=512, tie_word_embeddings=False),
    "30B-A3B": Qwen3MoeArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144,
                            moe_hidden_dim=768, num_experts=128, top_k=8, tie_word_embeddings=False),
    "235B-A22B": Qwen3MoeArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_dim=12288,
                              moe_hidden_dim=1536, num_experts=128, top_k=8, tie_word_embeddings=False),
}
