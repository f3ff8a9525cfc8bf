"""Hugging Face ``LlamaForCausalLM`` checkpoints: names, RoPE row order and ``config.json``.

The family-specific half of Hugging Face import and export (the generic half, reading and writing
sharded safetensors, is :mod:`torchtitan_lite.checkpoint.hf_storage`). Two layouts differ
besides the names:

- **RoPE.** Query and key rows are permuted within each head (interleaved pairs ours, halves
  Hugging Face's): :mod:`torchtitan_lite.models.decoder_hf`.
- **config.json.** :func:`hf_config` writes one for a shape; :func:`config_mismatch` names the
  first field of a file that disagrees with a shape or asks for computation the model lacks
  (family, sizes, head counts, tied embeddings, ``rms_norm_eps``, RoPE theta and scaling,
  activation, biases, dropout); :func:`model_args_from_hf_config` reads a shape of any size
  from one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_lite.models.decoder_hf import (
    DECODER_PER_LAYER,
    DECODER_TOP_LEVEL,
    NameMap,
    decoder_shapes,
    family_mismatch,
    ignored_hf_name,
    merged_rope_parameters,
    permute_for_hf,
    row_permutation,
    unpermute_from_hf,
)
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS, ModelArgs

__all__ = [
    "ADAPTER",
    "CONFIG_FILE",
    "LlamaHFAdapter",
    "config_mismatch",
    "expected_hf_shapes",
    "from_hf_name",
    "hf_config",
    "model_args_from_hf_config",
    "permute_for_hf",
    "to_hf_name",
    "unpermute_from_hf",
]

CONFIG_FILE = "config.json"

NAMES = NameMap("Llama", DECODER_TOP_LEVEL, DECODER_PER_LAYER)


def to_hf_name(name: str) -> str:
    """Our parameter name → the Hugging Face Llama name (``ValueError`` for an unknown name)."""
    return NAMES.to_hf(name)


def from_hf_name(name: str) -> str:
    """Hugging Face Llama name → our parameter name (``ValueError`` for an unknown name)."""
    return NAMES.from_hf(name)


def heads_to_permute(name: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows are permuted for parameter ``name`` (ours), or None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None



def expected_hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name → shape of every tensor a model with ``args`` needs, in file order
    (no ``lm_head.weight`` when the embeddings are tied)."""
    d, h, kv = args.dim, args.ffn_hidden_dim, args.kv_heads * args.head_dim
    return decoder_shapes(args, {
        "self_attn.q_proj.weight": (args.n_heads * args.head_dim, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, args.n_heads * args.head_dim),
        "mlp.gate_proj.weight": (h, d),
        "mlp.down_proj.weight": (d, h),
        "mlp.up_proj.weight": (h, d),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    })


def rope_parameters(args: ModelArgs) -> dict[str, Any]:
    """``rope_parameters`` of a ``config.json`` (the current layout: theta inside)."""
    params: dict[str, Any] = {"rope_type": "default" if args.rope_scaling == "none" else args.rope_scaling,
                              "rope_theta": args.rope_theta}
    if args.rope_scaling != "none":
        params["factor"] = args.rope_scaling_factor
    if args.rope_scaling == "llama3":
        params.update(low_freq_factor=args.rope_low_freq_factor, high_freq_factor=args.rope_high_freq_factor,
                      original_max_position_embeddings=args.rope_original_max_seq_len)
    return params


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` for a model with ``args`` stored in ``dtype``.

    RoPE is written in the current layout (``rope_parameters``) and, for readers that predate
    it, as ``rope_theta`` and ``rope_scaling`` too: the same values."""
    parameters = rope_parameters(args)
    legacy = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": parameters,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling == "none" else legacy,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE fields of a ``config.json`` in our terms (:func:`merged_rope_parameters`).
    ``ValueError`` for a RoPE type we do not implement (``yarn``, ``dynamic``, ``longrope``…) or
    a malformed entry."""
    parameters, where = merged_rope_parameters(config)
    kind = parameters.get("rope_type", parameters.get("type")) or "default"
    fields: dict[str, Any] = {}
    if parameters.get("rope_theta") is not None:
        fields["rope_theta"] = float(parameters["rope_theta"])
    if kind == "default":
        fields["rope_scaling"] = "none"
    elif kind in ("llama3", "linear"):
        try:
            fields.update(rope_scaling=kind, rope_scaling_factor=float(parameters["factor"]))
            if kind == "llama3":
                fields.update(rope_low_freq_factor=float(parameters["low_freq_factor"]),
                              rope_high_freq_factor=float(parameters["high_freq_factor"]),
                              rope_original_max_seq_len=int(parameters["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{CONFIG_FILE} {where} of type {kind!r} lacks a usable field: {exc}") from None
    else:
        raise ValueError(f"{CONFIG_FILE} has {where}.rope_type={kind!r}; supported RoPE types: "
                         "default, llama3, linear")
    return fields


def _family_mismatch(config: Mapping[str, Any]) -> str | None:
    return family_mismatch(config, LlamaHFAdapter.model_type, LlamaHFAdapter.architectures[0])


def config_mismatch(config: Mapping[str, Any], args: ModelArgs) -> str | None:
    """The first field of ``config`` that disagrees with ``args`` or that changes the
    computation in a way this model does not implement, as a phrase, or None."""
    problem = _family_mismatch(config)
    if problem is not None:
        return problem
    expected: list[tuple[str, Any, Any]] = [
        ("hidden_size", config.get("hidden_size"), args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", config.get("num_attention_heads"), args.n_heads),
        ("num_key_value_heads",
         config.get("num_key_value_heads", config.get("num_attention_heads")), args.kv_heads),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_hidden_dim),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
        ("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), args.tie_word_embeddings),
    ]
    if config.get("head_dim") is not None:
        expected.append(("head_dim", config.get("head_dim"), args.head_dim))
    for field, value, want in expected:
        if value is not None and value != want:
            return f"{CONFIG_FILE} has {field}={value!r} but this model has {field}={want!r}"
    try:
        rope = _rope_fields(config)
    except ValueError as exc:
        return str(exc)
    ours = {"rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling}
    if args.rope_scaling != "none":
        ours["rope_scaling_factor"] = args.rope_scaling_factor
    if args.rope_scaling == "llama3":
        ours.update(rope_low_freq_factor=args.rope_low_freq_factor, rope_high_freq_factor=args.rope_high_freq_factor,
                    rope_original_max_seq_len=args.rope_original_max_seq_len)
    numbers = [("rms_norm_eps", config.get("rms_norm_eps"), args.norm_eps)]
    numbers += [(field, rope.get(field), want) for field, want in ours.items() if field != "rope_scaling"]
    if rope.get("rope_scaling", "none") != args.rope_scaling:
        return (f"{CONFIG_FILE} has RoPE scaling {rope.get('rope_scaling', 'none')!r} but this model has "
                f"rope_scaling={args.rope_scaling!r}")
    for field, value, want in numbers:
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isclose(value, want, rel_tol=1e-6):
            return f"{CONFIG_FILE} has {field}={value!r} but this model has {field}={want!r}"
    if config.get("hidden_act", "silu") != "silu":
        return f"{CONFIG_FILE} has hidden_act={config['hidden_act']!r} but this model uses 'silu'"
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            return f"{CONFIG_FILE} has {field}=true but this model has no biases"
    if config.get("attention_dropout"):
        return f"{CONFIG_FILE} has attention_dropout={config['attention_dropout']!r} but this model has no dropout"
    return None


def model_args_from_hf_config(config: Mapping[str, Any], **overrides: Any) -> ModelArgs:
    """``ModelArgs`` for a Hugging Face Llama ``config.json`` of any shape (``ValueError``, one
    line, if it is not a Llama config or asks for something this model does not implement;
    ``overrides`` replace fields).

    ``intermediate_size`` is expressed through the flavor's ``multiple_of``/``ffn_dim_multiplier``
    when the shape is a flavor's, otherwise through ``multiple_of`` (and ``ffn_dim_multiplier``
    where needed) so that ``ffn_hidden_dim`` reproduces it exactly. The result is checked against
    the whole file (:func:`config_mismatch`)."""
    problem = _family_mismatch(config)
    if problem is not None:
        raise ValueError(problem)
    try:
        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        fields: dict[str, Any] = {
            "dim": dim,
            "n_layers": int(config["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
            "vocab_size": int(config["vocab_size"]),
            "norm_eps": float(config.get("rms_norm_eps", 1e-5)),
            "rope_theta": 10000.0,
            "max_seq_len": int(config.get("max_position_embeddings", 8192)),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
        hidden = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{CONFIG_FILE} lacks a usable Llama field: {exc}") from None
    fields.update(_rope_fields(config))
    shape = (dim, fields["n_layers"], n_heads, fields["n_kv_heads"], hidden)
    args = None
    free = {k: v for k, v in fields.items() if k not in ("dim", "n_layers", "n_heads", "n_kv_heads")}
    for flavor in LLAMA3_FLAVORS.values():  # a known flavor's FFN fields where the shape is one
        candidate = dataclasses.replace(flavor, **{**free, **overrides})
        if (candidate.dim, candidate.n_layers, candidate.n_heads, candidate.kv_heads,
                candidate.ffn_hidden_dim) == shape:
            args = candidate
            break
    if args is None:
        base = int(2 * 4 * dim / 3)
        fields.update(multiple_of=hidden, ffn_dim_multiplier=None if base <= hidden else hidden / base)
        fields.update(overrides)
        args = ModelArgs(**fields)
        if args.ffn_hidden_dim != hidden:
            raise ValueError(f"{CONFIG_FILE} intermediate_size={hidden} cannot be expressed by ModelArgs")
    problem = config_mismatch(config, args)
    if problem is not None:
        raise ValueError(problem)
    return args


class LlamaHFAdapter:
    """The Llama family's Hugging Face adapter (the :class:`~torchtitan_lite.models.spec.HFAdapter`
    of its model spec)."""

    architectures = ("LlamaForCausalLM",)
    model_type = "llama"
    output_name = "output.weight"
    """Our name of the output projection (absent from files with tied embeddings)."""
    embedding_name = "tok_embeddings.weight"
    """Our name of the token embedding (what a tied output projection is loaded from)."""

    to_hf_name = staticmethod(to_hf_name)
    from_hf_name = staticmethod(from_hf_name)
    expected_shapes = staticmethod(expected_hf_shapes)
    config_for = staticmethod(hf_config)
    config_mismatch = staticmethod(config_mismatch)
    args_from_config = staticmethod(model_args_from_hf_config)

    ignored = staticmethod(ignored_hf_name)

    @staticmethod
    def row_permutation(name: str, args: ModelArgs, *, to_hf: bool) -> torch.Tensor | None:
        """Row indices ``idx`` with ``converted = w[idx]`` for our parameter ``name``
        (``to_hf``: ours → Hugging Face, else back), or None when its rows stay in place."""
        heads = heads_to_permute(name, args)
        if heads is None:
            return None
        rows = heads * args.head_dim
        return row_permutation(rows, heads, to_hf=to_hf)


ADAPTER = LlamaHFAdapter()
