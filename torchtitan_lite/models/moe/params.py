"""Parameter and FLOP counts of a decoder whose args have mixture-of-experts layers."""

from __future__ import annotations

from torchtitan_lite.models.spec import DecoderArgs

__all__ = ["MoEParams"]


class MoEParams(DecoderArgs):
    """Parameter counts of a decoder whose args have MoE layers (mixed into a family's args):
    ``num_params`` counts every expert, ``active_params`` the ``top_k`` routed experts a token
    goes through (what its FLOPs follow)."""

    def _moe_block_params(self, *, active: bool) -> int:
        a = self
        experts = a.top_k if active else a.num_experts
        routed = 3 * a.dim * a.moe_hidden_dim * experts
        shared = 3 * a.dim * a.shared_hidden_dim
        return a.dim * a.num_experts + routed + shared

    def moe_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return sum(bool(self.moe_layer(i)) for i in range(self.n_layers))

    def _with_moe(self, dense_total: int, *, active: bool) -> int:
        dense_ffn = 3 * self.dim * self.ffn_hidden_dim
        return dense_total + self.moe_layers() * (self._moe_block_params(active=active) - dense_ffn)

    def active_params(self, *, include_embedding: bool = True) -> int:
        """Parameters a token's forward uses (the ``top_k`` routed experts of each MoE layer)."""
        return self._with_moe(super().num_params(include_embedding=include_embedding), active=True)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Every parameter, each expert's included."""
        return self._with_moe(super().num_params(include_embedding=include_embedding), active=False)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 × the non-embedding parameters a token uses (the active
        experts only) plus the attention matmuls."""
        return 6 * self.active_params(include_embedding=False) + self.n_layers * self.attention_flops_per_token(seq_len)
