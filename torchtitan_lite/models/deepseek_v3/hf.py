"""Hugging Face ``DeepseekV3ForCausalLM`` checkpoints: the DeepSeek-V3 family's configuration of
the decoder adapter (:class:`~torchtitan_lite.models.decoder_hf.DecoderHFAdapter`).

Names: the decoder's embedding, norms and dense feed-forwards; the latent attention's own
(:data:`~torchtitan_lite.models.deepseek_v3.attention.MLA_HF_NAMES`: ``q_a_proj``/``q_a_layernorm``/
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``);
the MoE layers' ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias`` (our router's
``expert_bias``, kept in fp32 on export as transformers keeps it), ``mlp.experts.{e}.*`` and
``mlp.shared_experts.*``. The rotary rows are stored interleaved, as ours (``rope_interleave:
true``, DeepSeek's layout), so nothing is permuted; files with ``rope_interleave: false`` store
them as halves and are permuted on import and export (:meth:`DeepseekV3HFAdapter.row_permutation`).

``config.json`` as ``transformers`` 5 reads it: ``q_lora_rank: null`` is our 0 (no query
bottleneck; an absent key is transformers' default 1536); ``head_dim`` is ``qk_rope_head_dim`` and
``num_key_value_heads`` equals ``num_attention_heads``; YaRN's optional settings take
transformers' defaults (``beta_fast`` 32, ``beta_slow`` 1, no ``mscale``/``mscale_all_dim``,
``truncate`` true, ``original_max_position_embeddings`` = ``max_position_embeddings``). Refused,
one line each: quantized weights (``quantization_config``: DeepSeek-V3's published weights are
fp8 blocks, to be dequantized to bf16 first), a ``topk_method`` other than ``noaux_tc``,
``moe_layer_freq`` other than 1, a ``scoring_func`` other than ``sigmoid`` (transformers ignores
these three keys: such a file would not compute what it says), an explicit YaRN
``attention_factor``, attention biases.

Skipped: the multi-token-prediction layer the published checkpoints carry as
``model.layers.<num_hidden_layers>.*`` (``num_nextn_predict_layers``; transformers drops it too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_lite.models.decoder_hf import (
    CONFIG_FILE,
    ConfigField,
    DecoderHFAdapter,
    RopeField,
    merged_rope_parameters,
    row_permutation,
)
from torchtitan_lite.models.deepseek_v3.attention import MLA_HF_NAMES, mla_hf_shapes
from torchtitan_lite.models.deepseek_v3.model import DeepseekV3Args

__all__ = ["ADAPTER", "DeepseekV3HFAdapter"]

_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
"""transformers' YaRN settings where a file leaves them out (or null/0: ``get(...) or default``;
an unset mscale is our 0)."""


def _args_from_fields(fields: dict[str, Any]) -> DeepseekV3Args:
    """``DeepseekV3Args`` from a file's fields: ``n_kv_heads`` is not a field (every head has its
    keys; the size check compares ``num_key_value_heads`` with ``n_heads``)."""
    return DeepseekV3Args(**{k: v for k, v in fields.items() if k != "n_kv_heads"})


class DeepseekV3HFAdapter(DecoderHFAdapter):
    """:class:`DecoderHFAdapter` with DeepSeek-V3's ``config.json`` conventions (null
    ``q_lora_rank``, YaRN defaults, the refusals above) and the rotary row permutation of
    ``rope_interleave: false`` files."""

    # ---- config.json -------------------------------------------------------------------------

    def _deepseek_problem(self, config: Mapping[str, Any]) -> str | None:
        """The field of a ``config.json`` that asks for what transformers' ``DeepseekV3ForCausalLM``
        (and this model) does not compute, as a phrase, or None."""
        if config.get("model_type") not in (None, self.model_type):
            return None  # the generic check names the family
        quantization = config.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
            return (f"{CONFIG_FILE} has quantization_config (quant_method={method!r}): the weights are quantized; "
                    "dequantize them to bf16 first (DeepSeek-V3's published weights are fp8 blocks) and remove "
                    "quantization_config")
        for key, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
            value = config.get(key)
            if value is not None and value != supported:
                return (f"{CONFIG_FILE} has {key}={value!r} but {self.architecture} computes only "
                        f"{key}={supported!r} (transformers ignores {key})")
        try:
            parameters, where = merged_rope_parameters(config)
        except ValueError:
            return None  # the generic check reports it
        if parameters.get("attention_factor") is not None:
            return (f"{CONFIG_FILE} has {where}.attention_factor={parameters['attention_factor']!r}; "
                    f"{self.architecture} here derives YaRN's attention factor from mscale and mscale_all_dim")
        return None

    @staticmethod
    def _normalised(config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` as transformers reads it: ``q_lora_rank: null`` → 0 and YaRN's optional
        settings filled in (``ValueError`` for contradictory RoPE settings)."""
        config = dict(config)
        if "q_lora_rank" in config and config["q_lora_rank"] is None:
            config["q_lora_rank"] = 0
        parameters, _ = merged_rope_parameters(config)
        if parameters.get("rope_type", parameters.get("type")) == "yarn":
            max_positions = config.get("max_position_embeddings") or 4096
            original = config.get("original_max_position_embeddings") or parameters.get(
                "original_max_position_embeddings") or max_positions
            filled = {**parameters, "rope_type": "yarn", "original_max_position_embeddings": original,
                      **{k: parameters.get(k) or default for k, default in _YARN_DEFAULTS.items()}}
            filled.pop("type", None)
            if filled.get("factor") is None:
                filled["factor"] = max_positions / original
            filled["truncate"] = bool(parameters.get("truncate", True))
            config["rope_parameters"], config["rope_scaling"] = filled, None
        return config

    def config_mismatch(self, config: Mapping[str, Any], args: Any) -> str | None:
        problem = self._deepseek_problem(config)
        if problem is not None:
            return problem
        try:
            config = self._normalised(config)
        except ValueError as exc:
            return str(exc)
        return super().config_mismatch(config, args)

    def args_from_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        problem = self._deepseek_problem(config)
        if problem is not None:
            raise ValueError(problem)
        return super().args_from_config(self._normalised(config), **overrides)

    def config_for(self, args: Any, dtype: torch.dtype) -> dict[str, Any]:
        """The decoder's ``config.json`` with ``q_lora_rank: null`` for no query bottleneck,
        unset YaRN mscales left out (transformers reads both as ``None``) and the legacy
        ``rope_scaling`` also keyed ``type`` (what DeepSeek's own modeling code reads)."""
        config = super().config_for(args, dtype)
        if not args.q_lora_rank:
            config["q_lora_rank"] = None
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(config.get(key), dict):
                config[key] = {
                    k: v for k, v in config[key].items() if not (k in ("mscale", "mscale_all_dim") and not v)
                }
        if isinstance(config.get("rope_scaling"), dict):
            config["rope_scaling"]["type"] = config["rope_scaling"]["rope_type"]
        return config

    # ---- row layouts -------------------------------------------------------------------------

    def row_permutation(self, name: str, args: Any, *, to_hf: bool) -> torch.Tensor | None:
        """None (rows in place) for files in DeepSeek's interleaved layout; for
        ``rope_interleave: false`` files, the rotary rows of the query projection (each head's
        last ``qk_rope_head_dim`` rows) and of the latent projection (its last
        ``qk_rope_head_dim`` rows) between interleaved pairs (ours) and halves."""
        if getattr(args, "rope_interleave", True):
            return super().row_permutation(name, args, to_hf=to_hf)
        rope = args.qk_rope_head_dim
        pairs = row_permutation(rope, 1, to_hf=to_hf)
        if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
            index = torch.arange(args.n_heads * args.qk_head_dim).view(args.n_heads, args.qk_head_dim)
            index[:, args.qk_nope_head_dim:] = index[:, args.qk_nope_head_dim:][:, pairs]
            return index.flatten()
        if name.endswith("attention.wkv_a.weight"):
            index = torch.arange(args.kv_lora_rank + rope)
            index[args.kv_lora_rank:] = index[args.kv_lora_rank:][pairs]
            return index
        return super().row_permutation(name, args, to_hf=to_hf)


_YARN = (RopeField("factor", "rope_factor"), RopeField("original_max_position_embeddings", "original_max_seq_len", int),
         RopeField("beta_fast", "beta_fast"), RopeField("beta_slow", "beta_slow"), RopeField("mscale", "mscale"),
         RopeField("mscale_all_dim", "mscale_all_dim"), RopeField("truncate", "rope_truncate", bool))


def _lora_rank(value: Any) -> int:
    return int(value or 0)


ADAPTER = DeepseekV3HFAdapter(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    args_cls=DeepseekV3Args,
    config_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
    off_fields={"attention_bias": False, "attention_dropout": 0.0},
    rope_scalings={"yarn": _YARN},
    extra_fields=(
        ConfigField(("q_lora_rank",), "q_lora_rank", _lora_rank, 1536),
        ConfigField(("kv_lora_rank",), "kv_lora_rank", int, 512),
        ConfigField(("qk_nope_head_dim",), "qk_nope_head_dim", int, 128),
        ConfigField(("qk_rope_head_dim",), "qk_rope_head_dim", int, 64),
        ConfigField(("v_head_dim",), "v_head_dim", int, 128),
        ConfigField(("rope_interleave",), "rope_interleave", bool, True),
        ConfigField(("n_routed_experts", "num_local_experts"), "num_experts", int, 256),
        ConfigField(("num_experts_per_tok",), "top_k", int, 8),
        ConfigField(("moe_intermediate_size",), "moe_hidden_dim", int, 2048),
        ConfigField(("n_shared_experts",), "n_shared_experts", int, 1),
        ConfigField(("first_k_dense_replace",), "first_k_dense_replace", int, 3),
        ConfigField(("norm_topk_prob",), "norm_topk_prob", bool, True),
        ConfigField(("routed_scaling_factor",), "route_scale", float, 2.5),
        ConfigField(("n_group",), "n_group", int, 8),
        ConfigField(("topk_group",), "topk_group", int, 4),
        ConfigField(("scoring_func",), "score_func", str, "sigmoid"),
    ),
    attention_names=MLA_HF_NAMES,
    attention_shapes=mla_hf_shapes,
    extra_config={"topk_method": "noaux_tc", "moe_layer_freq": 1, "num_nextn_predict_layers": 0},
    build_args=_args_from_fields,
    layers_beyond_ignored=True,
)
"""The DeepSeek-V3 family's Hugging Face adapter."""
