"""Hugging Face ``Qwen3ForCausalLM`` checkpoints (and, through the same adapter class, Qwen2's):
names, RoPE row order and ``config.json``.

Names are Llama's plus, for Qwen3, ``self_attn.q_norm``/``k_norm`` and, for Qwen2, the biases of
``q_proj``/``k_proj``/``v_proj``. Query and key rows (their biases, and the q/k norm weights of
one head's width) are permuted within each head as for any decoder of ours
(:mod:`torchtitan_lite.models.decoder_hf`). ``config.json`` must describe a dense model with
unscaled RoPE, SiLU and no sliding window; anything else is one line.
"""

from __future__ import annotations

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
    row_permutation,
)
from torchtitan_lite.models.qwen3.model import Qwen3Args

__all__ = ["ADAPTER", "QwenHFAdapter"]

CONFIG_FILE = "config.json"

_QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_QKV_BIASES = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}


class QwenHFAdapter:
    """A Qwen family's Hugging Face adapter (:class:`~torchtitan_lite.models.spec.HFAdapter`):
    Qwen3 (q/k norms, its own head size) or Qwen2 (q/k/v biases), per ``args_cls``'s
    ``qk_norm``/``qkv_bias``."""

    output_name = "output.weight"
    embedding_name = "tok_embeddings.weight"

    def __init__(self, model_type: str, architecture: str, args_cls: type) -> None:
        self.model_type = model_type
        self.architectures = (architecture,)
        self.args_cls = args_cls
        self.qk_norm: bool = args_cls.qk_norm
        self.qkv_bias: bool = args_cls.qkv_bias
        per_layer = {**DECODER_PER_LAYER, **(_QK_NORMS if self.qk_norm else {}),
                     **(_QKV_BIASES if self.qkv_bias else {})}
        self.names = NameMap(architecture.removesuffix("ForCausalLM"), DECODER_TOP_LEVEL, per_layer)

    def to_hf_name(self, name: str) -> str:
        return self.names.to_hf(name)

    def from_hf_name(self, hf_name: str) -> str:
        return self.names.from_hf(hf_name)

    ignored = staticmethod(ignored_hf_name)

    def expected_shapes(self, args: Any) -> dict[str, tuple[int, ...]]:
        """Hugging Face name → shape of every tensor a model with ``args`` needs, in file order."""
        d, h = args.dim, args.ffn_hidden_dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        per_layer = {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                     "self_attn.v_proj.weight": (kv, d)}
        if self.qkv_bias:
            per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                              "self_attn.v_proj.bias": (kv,)})
        per_layer["self_attn.o_proj.weight"] = (d, q)
        if self.qk_norm:
            per_layer.update({"self_attn.q_norm.weight": (args.head_dim,), "self_attn.k_norm.weight": (args.head_dim,)})
        per_layer.update({"mlp.gate_proj.weight": (h, d), "mlp.down_proj.weight": (d, h), "mlp.up_proj.weight": (h, d),
                          "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)})
        return decoder_shapes(args, per_layer)

    def config_for(self, args: Any, dtype: torch.dtype) -> dict[str, Any]:
        """A ``config.json`` for ``args`` stored in ``dtype`` (RoPE in both layouts)."""
        config = {
            "architectures": list(self.architectures), "model_type": self.model_type,
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "num_hidden_layers": args.n_layers, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "rope_theta": args.rope_theta, "rope_scaling": None,
            "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
            "attention_dropout": 0.0, "use_sliding_window": False,
            "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if self.qk_norm:
            config.update(head_dim=args.head_dim, attention_bias=False)
        return config

    def _rope_theta(self, config: Mapping[str, Any]) -> Any:
        parameters, where = merged_rope_parameters(config)
        kind = parameters.get("rope_type", parameters.get("type")) or "default"
        if kind != "default":
            raise ValueError(f"{CONFIG_FILE} has {where}.rope_type={kind!r}; {self.architectures[0]} here "
                             "supports only default RoPE")
        return parameters.get("rope_theta")

    def _unsupported(self, config: Mapping[str, Any]) -> str | None:
        problem = family_mismatch(config, self.model_type, self.architectures[0])
        if problem is not None:
            return problem
        if config.get("hidden_act", "silu") != "silu":
            return f"{CONFIG_FILE} has hidden_act={config['hidden_act']!r} but this model uses 'silu'"
        if self.qk_norm and config.get("attention_bias"):
            return f"{CONFIG_FILE} has attention_bias=true but this model has no biases"
        if config.get("use_sliding_window"):
            return f"{CONFIG_FILE} has use_sliding_window=true but this model attends to the whole sequence"
        if config.get("attention_dropout"):
            return f"{CONFIG_FILE} has attention_dropout={config['attention_dropout']!r} but this model has no dropout"
        return None

    def config_mismatch(self, config: Mapping[str, Any], args: Any) -> str | None:
        """The first field of ``config`` that disagrees with ``args`` or asks for computation
        this model lacks, as a phrase, or None."""
        problem = self._unsupported(config)
        if problem is not None:
            return problem
        try:
            theta = self._rope_theta(config)
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

    def args_from_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        """The family's args for a ``config.json`` of any size (``ValueError``, one line, for
        another family or computation this model lacks); defaults as ``transformers``' config
        class has them."""
        problem = self._unsupported(config)
        if problem is not None:
            raise ValueError(problem)
        try:
            n_heads = int(config["num_attention_heads"])
            fields: dict[str, Any] = dict(
                dim=int(config["hidden_size"]), n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                ffn_hidden_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(self._rope_theta(config) or 10000.0),
                max_seq_len=int(config.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
            if self.qk_norm:  # Qwen3: a head size of its own (transformers' default 128)
                fields["head_dim"] = int(config.get("head_dim") or 128)
            args = self.args_cls(**{**fields, **overrides})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{CONFIG_FILE} lacks a usable {self.architectures[0]} field: {exc}") from None
        problem = self.config_mismatch(config, args)
        if problem is not None:
            raise ValueError(problem)
        return args

    def row_permutation(self, name: str, args: Any, *, to_hf: bool) -> torch.Tensor | None:
        """Query/key rows (and biases) within each head, and the q/k norm weights (one head),
        interleaved pairs (ours) ↔ halves (Hugging Face's)."""
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            heads = args.n_heads
        elif name.endswith(("attention.wk.weight", "attention.wk.bias")):
            heads = args.n_kv_heads
        elif name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            heads = 1
        else:
            return None
        return row_permutation(heads * args.head_dim, heads, to_hf=to_hf)


ADAPTER = QwenHFAdapter("qwen3", "Qwen3ForCausalLM", Qwen3Args)
