"""Hugging Face ``Qwen3ForCausalLM`` checkpoints: names, RoPE row order and ``config.json``.

Names are Llama's plus ``self_attn.q_norm``/``k_norm``; query and key rows, and the q/k norm
weights (one head's width), are permuted within each head as for any decoder of ours
(:mod:`torchtitan_lite.models.decoder_hf`). ``config.json`` must describe a dense Qwen3 with
unscaled RoPE, SiLU, no attention biases and no sliding window; anything else is one line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_lite.models.decoder_hf import NameMap, merged_rope_parameters, row_permutation
from torchtitan_lite.models.qwen3.model import Qwen3Args

__all__ = ["ADAPTER", "Qwen3HFAdapter"]

CONFIG_FILE = "config.json"

NAMES = NameMap("Qwen3", {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}, {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
})
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def expected_hf_shapes(args: Qwen3Args) -> dict[str, tuple[int, ...]]:
    """Hugging Face name → shape of every tensor a model with ``args`` needs, in file order."""
    d, h, q, kv = args.dim, args.ffn_hidden_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer = {
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d), "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q), "self_attn.q_norm.weight": (args.head_dim,),
        "self_attn.k_norm.weight": (args.head_dim,), "mlp.gate_proj.weight": (h, d), "mlp.down_proj.weight": (d, h),
        "mlp.up_proj.weight": (h, d), "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
    }
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    shapes["model.norm.weight"] = (d,)
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, d)
    return shapes


def hf_config(args: Qwen3Args, dtype: torch.dtype) -> dict[str, Any]:
    """A ``Qwen3ForCausalLM`` ``config.json`` (RoPE in the current and the earlier layout)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "num_hidden_layers": args.n_layers, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_theta": args.rope_theta, "rope_scaling": None,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_theta(config: Mapping[str, Any]) -> Any:
    parameters, where = merged_rope_parameters(config)
    kind = parameters.get("rope_type", parameters.get("type")) or "default"
    if kind != "default":
        raise ValueError(f"{CONFIG_FILE} has {where}.rope_type={kind!r}; Qwen3 here supports only default RoPE")
    return parameters.get("rope_theta")


def _unsupported(config: Mapping[str, Any]) -> str | None:
    model_type = config.get("model_type")
    if model_type is not None and model_type != "qwen3":
        return f"{CONFIG_FILE} has model_type={model_type!r} but this model is 'qwen3' (Qwen3ForCausalLM)"
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and "Qwen3ForCausalLM" not in architectures:
        return f"{CONFIG_FILE} has architectures={architectures!r} but this model is Qwen3ForCausalLM"
    if config.get("hidden_act", "silu") != "silu":
        return f"{CONFIG_FILE} has hidden_act={config['hidden_act']!r} but this model uses 'silu'"
    if config.get("attention_bias"):
        return f"{CONFIG_FILE} has attention_bias=true but this model has no biases"
    if config.get("use_sliding_window"):
        return f"{CONFIG_FILE} has use_sliding_window=true but this model attends to the whole sequence"
    if config.get("attention_dropout"):
        return f"{CONFIG_FILE} has attention_dropout={config['attention_dropout']!r} but this model has no dropout"
    return None


def config_mismatch(config: Mapping[str, Any], args: Qwen3Args) -> str | None:
    """The first field of ``config`` that disagrees with ``args`` or asks for computation this
    model lacks, as a phrase, or None."""
    problem = _unsupported(config)
    if problem is not None:
        return problem
    try:
        theta = _rope_theta(config)
    except ValueError as exc:
        return str(exc)
    exact = [("hidden_size", args.dim), ("num_hidden_layers", args.n_layers), ("num_attention_heads", args.n_heads),
             ("num_key_value_heads", args.n_kv_heads), ("head_dim", args.head_dim),
             ("intermediate_size", args.ffn_hidden_dim), ("vocab_size", args.vocab_size)]
    for field, want in exact:
        if config.get(field) is not None and config[field] != want:
            return f"{CONFIG_FILE} has {field}={config[field]!r} but this model has {field}={want!r}"
    tied = bool(config.get("tie_word_embeddings", False))
    if tied != args.tie_word_embeddings:
        return (f"{CONFIG_FILE} has tie_word_embeddings={tied!r} but this model has "
                f"tie_word_embeddings={args.tie_word_embeddings!r}")
    for field, value, want in (("rms_norm_eps", config.get("rms_norm_eps"), args.norm_eps),
                               ("rope_theta", theta, args.rope_theta)):
        if value is not None and (not isinstance(value, (int, float)) or not math.isclose(value, want, rel_tol=1e-6)):
            return f"{CONFIG_FILE} has {field}={value!r} but this model has {field}={want!r}"
    return None


def args_from_config(config: Mapping[str, Any], **overrides: Any) -> Qwen3Args:
    """``Qwen3Args`` for a Hugging Face Qwen3 ``config.json`` of any size (``ValueError``, one
    line, for another family or computation this model lacks)."""
    problem = _unsupported(config)
    if problem is not None:
        raise ValueError(problem)
    try:
        n_heads = int(config["num_attention_heads"])
        dim = int(config["hidden_size"])
        args = Qwen3Args(
            dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or 128),  # transformers' Qwen3Config defaults
            ffn_hidden_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(_rope_theta(config) or 10000.0),
            max_seq_len=int(config.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{CONFIG_FILE} lacks a usable Qwen3 field: {exc}") from None
    args = dataclasses.replace(args, **overrides)
    problem = config_mismatch(config, args)
    if problem is not None:
        raise ValueError(problem)
    return args


class Qwen3HFAdapter:
    """The Qwen3 family's Hugging Face adapter (:class:`~torchtitan_lite.models.spec.HFAdapter`)."""

    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"
    output_name = "output.weight"
    embedding_name = "tok_embeddings.weight"

    to_hf_name = staticmethod(NAMES.to_hf)
    from_hf_name = staticmethod(NAMES.from_hf)
    expected_shapes = staticmethod(expected_hf_shapes)
    config_for = staticmethod(hf_config)
    config_mismatch = staticmethod(config_mismatch)
    args_from_config = staticmethod(args_from_config)

    @staticmethod
    def ignored(hf_name: str) -> bool:
        return bool(_IGNORED_HF.search(hf_name))

    @staticmethod
    def row_permutation(name: str, args: Qwen3Args, *, to_hf: bool) -> torch.Tensor | None:
        """Query/key rows within each head, and the q/k norm weights (one head), interleaved pairs
        (ours) ↔ halves (Hugging Face's)."""
        if name.endswith("attention.wq.weight"):
            heads = args.n_heads
        elif name.endswith("attention.wk.weight"):
            heads = args.n_kv_heads
        elif name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            heads = 1
        else:
            return None
        return row_permutation(heads * args.head_dim, heads, to_hf=to_hf)


ADAPTER = Qwen3HFAdapter()
