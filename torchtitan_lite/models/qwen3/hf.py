"""Hugging Face ``Qwen3ForCausalLM`` checkpoints: the Qwen3 family's configuration of the decoder
adapter (:class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`).

Names are the decoder's plus ``self_attn.q_norm``/``k_norm`` (whose weights, one head wide, are
permuted like query and key rows); ``head_dim`` is a shape field of its own (``transformers``'
default 128). ``config.json`` must describe a dense model with unscaled RoPE, SiLU and no
sliding window; anything else is one line.
"""

from __future__ import annotations

from torchtitan_lite.models.decoder_hf import DecoderHFAdapter
from torchtitan_lite.models.qwen3.model import Qwen3Args

__all__ = ["ADAPTER"]

ADAPTER = DecoderHFAdapter(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    args_cls=Qwen3Args,
    config_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    off_fields={"attention_dropout": 0.0, "use_sliding_window": False, "attention_bias": False},
)
"""The Qwen3 family's Hugging Face adapter."""
