"""Hugging Face ``Qwen3MoeForCausalLM`` checkpoints: the Qwen3-MoE family's configuration of the
decoder adapter (:class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`).

Qwen3's names plus the MoE layers': ``mlp.gate.weight`` (the router) and each expert's
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (stacked here as ``moe.experts.w1/w3/w2``).
``config.json``'s expert count is read from ``num_experts`` or, as transformers 5 writes it,
``num_local_experts``.
"""

from __future__ import annotations

import dataclasses

from torchtitan_lite.models.decoder_hf import ConfigField, tuple_of_ints
from torchtitan_lite.models.qwen3.hf import ADAPTER as QWEN3_ADAPTER
from torchtitan_lite.models.qwen3_moe.model import Qwen3MoeArgs

__all__ = ["ADAPTER"]

ADAPTER = dataclasses.replace(
    QWEN3_ADAPTER,  # Qwen3's attention, defaults and off fields, with its experts
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    args_cls=Qwen3MoeArgs,
    extra_fields=(
        ConfigField(("num_experts", "num_local_experts"), "num_experts", int, 128),
        ConfigField(("num_experts_per_tok",), "top_k", int, 8),
        ConfigField(("moe_intermediate_size",), "moe_hidden_dim", int, 768),
        ConfigField(("norm_topk_prob",), "norm_topk_prob", bool, False),
        ConfigField(("decoder_sparse_step",), "decoder_sparse_step", int, 1),
        ConfigField(("mlp_only_layers",), "mlp_only_layers", tuple_of_ints, ()),
        ConfigField(("router_aux_loss_coef",), "router_aux_loss_coef", float, 0.001),
        ConfigField((), "score_func", str, "softmax"),
    ),
)
"""The Qwen3-MoE family's Hugging Face adapter."""
