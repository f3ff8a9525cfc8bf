"""Hugging Face ``LlamaForCausalLM`` checkpoints: the Llama family's configuration of the decoder
adapter (:class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`).

Llama's names are the decoder's (no q/k norms, no biases); its RoPE may be scaled (Llama 3.1's
``llama3`` frequency scaling or ``linear``); ``intermediate_size`` is expressed through
``multiple_of``/``ffn_dim_multiplier`` (:func:`_args_from_fields`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_lite.models.decoder_hf import CONFIG_FILE, DecoderHFAdapter, RopeField
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS, ModelArgs

__all__ = ["ADAPTER"]

_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads")


def _args_from_fields(fields: dict[str, Any]) -> ModelArgs:
    """``ModelArgs`` for a file's fields: ``ffn_hidden_dim`` is expressed through the flavor's
    ``multiple_of``/``ffn_dim_multiplier`` when the shape is a flavor's, otherwise through
    ``multiple_of`` (and ``ffn_dim_multiplier`` where needed) so that ``ffn_hidden_dim``
    reproduces it exactly."""
    free = {k: v for k, v in fields.items() if k != "ffn_hidden_dim"}
    hidden = fields["ffn_hidden_dim"]
    shape = (*(fields[k] for k in _SHAPE), hidden)
    for flavor in LLAMA3_FLAVORS.values():  # a known flavor's FFN fields where the shape is one
        candidate = dataclasses.replace(flavor, **{k: v for k, v in free.items() if k not in _SHAPE})
        if (candidate.dim, candidate.n_layers, candidate.n_heads, candidate.kv_heads,
                candidate.ffn_hidden_dim) == shape:
            return candidate
    base = int(2 * 4 * free["dim"] / 3)
    args = ModelArgs(**{"multiple_of": hidden, "ffn_dim_multiplier": None if base <= hidden else hidden / base,
                        **free})
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"{CONFIG_FILE} intermediate_size={hidden} cannot be expressed by ModelArgs")
    return args


_FACTOR = RopeField("factor", "rope_scaling_factor")

ADAPTER = DecoderHFAdapter(
    model_type="llama",
    architecture="LlamaForCausalLM",
    args_cls=ModelArgs,
    config_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 8192},
    off_fields={"attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False},
    rope_scalings={
        "llama3": (_FACTOR, RopeField("low_freq_factor", "rope_low_freq_factor"),
                   RopeField("high_freq_factor", "rope_high_freq_factor"),
                   RopeField("original_max_position_embeddings", "rope_original_max_seq_len", int)),
        "linear": (_FACTOR,),
    },
    build_args=_args_from_fields,
)
"""The Llama family's Hugging Face adapter."""
