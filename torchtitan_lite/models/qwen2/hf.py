"""Hugging Face ``Qwen2ForCausalLM`` checkpoints (Qwen2 and Qwen2.5): the Qwen2 family's
configuration of the decoder adapter (:class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`).

Names are the decoder's plus the biases of ``q_proj``/``k_proj``/``v_proj`` (query and key
biases permuted like their rows); the head size is ``hidden_size / num_attention_heads`` and
``config.json`` has no ``head_dim``. It must describe a dense model with unscaled RoPE, SiLU and
no sliding window; anything else is one line.
"""

from __future__ import annotations

from torchtitan_lite.models.decoder_hf import DecoderHFAdapter
from torchtitan_lite.models.qwen2.model import Qwen2Args

__all__ = ["ADAPTER"]

ADAPTER = DecoderHFAdapter(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    args_cls=Qwen2Args,
    config_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    off_fields={"attention_dropout": 0.0, "use_sliding_window": False},
    head_dim_in_config=False,
)
"""The Qwen2 family's Hugging Face adapter."""
