"""The Hugging Face adapter of our decoder families: :class:`DecoderHFAdapter`, one class that each
family configures with its data (``ADAPTER = DecoderHFAdapter(...)`` in ``models/<family>/hf.py``).
It is the family-specific half of Hugging Face import and export; the generic half, reading and
writing sharded safetensors, is :mod:`torchtitan_lite.checkpoint.hf_storage`.

**Names.** Ours (``layers.N.attention.wq.weight``) ↔ Hugging Face's
(``model.layers.N.self_attn.q_proj.weight``): the same for every decoder, plus the optional tensors
of a family (q/k norms, q/k/v biases; its args class says which).

**RoPE.** Our decoder rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face's
implementations rotate halves (``rotate_half``). Query and key weights (their biases, and the
per-head q/k norm weights) are the same up to a permutation of rows within each head:
:func:`permute_for_hf` and :func:`unpermute_from_hf`.

**config.json.** :meth:`DecoderHFAdapter.config_for` writes one for a shape (RoPE in the current
``rope_parameters`` layout and, for earlier readers, as ``rope_theta``/``rope_scaling``);
:meth:`~DecoderHFAdapter.config_mismatch` names the first field of a file that asks for
computation the model lacks or disagrees with a shape (family, activation, biases, sliding
window, dropout, RoPE type, sizes, tied embeddings, ``rms_norm_eps``, RoPE theta and scaling);
:meth:`~DecoderHFAdapter.args_from_config` reads a shape of any size from one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from torchtitan_lite.models.decoder import is_moe_layer

__all__ = ["CONFIG_FILE", "OFF_FIELDS", "ConfigField", "DecoderHFAdapter", "RopeField", "merged_rope_parameters",
           "permute_for_hf", "row_permutation", "tuple_of_ints", "unpermute_from_hf"]

CONFIG_FILE = "config.json"


# --------------------------------------------------------------------------------------------
# RoPE: config.json's settings and the row permutation
# --------------------------------------------------------------------------------------------


def merged_rope_parameters(config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A ``config.json``'s RoPE settings as one dict, read as ``transformers`` reads them:
    ``rope_parameters`` (the current layout) with the earlier ``rope_scaling`` entries over it
    (a ``rope_scaling`` added to a current file wins, as in ``transformers``), and the top-level
    ``rope_theta``; and the name of the key that set the RoPE type (for messages). A top-level
    ``rope_theta`` that contradicts ``rope_parameters`` is a ``ValueError``."""
    parameters = config.get("rope_parameters")
    merged: dict[str, Any] = dict(parameters) if isinstance(parameters, dict) else {}
    where = "rope_parameters"
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        merged.update(scaling)
        if "rope_type" in scaling or "type" in scaling:
            where = "rope_scaling"
    theta = config.get("rope_theta")
    if theta is not None:
        if merged.get("rope_theta") is not None and merged["rope_theta"] != theta:
            raise ValueError(f"config.json has rope_theta={theta!r} but rope_parameters.rope_theta="
                             f"{merged['rope_theta']!r}")
        merged["rope_theta"] = theta
    return merged, where


def _check_rows(w: torch.Tensor, n_heads: int) -> tuple[int, int]:
    if w.dim() != 2 or n_heads <= 0 or w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise ValueError(
            f"expected a 2-D weight whose {w.shape[0] if w.dim() else 0} rows split into {n_heads} "
            f"heads of even size, got shape {list(w.shape)}"
        )
    return w.shape[0] // n_heads, w.shape[1]


def permute_for_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a query/key weight from interleaved-pair RoPE (ours) to half-split RoPE (HF).

    Within each head, our row ``2i + p`` (pair ``i``, component ``p``) becomes row
    ``p · head_dim/2 + i``.
    """
    head_dim, dim = _check_rows(w, n_heads)
    return w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim)


def unpermute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_hf`: half-split RoPE rows (HF) back to interleaved pairs."""
    head_dim, dim = _check_rows(w, n_heads)
    return w.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim)


def row_permutation(rows: int, n_heads: int, *, to_hf: bool) -> torch.Tensor:
    """Indices ``idx`` with ``permuted = w[idx]`` (``to_hf``: ours → HF, else HF → ours)."""
    index = torch.arange(rows).unsqueeze(1)  # permuting the row numbers gives the gather index
    permuted = permute_for_hf(index, n_heads) if to_hf else unpermute_from_hf(index, n_heads)
    return permuted.squeeze(1)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_MOE_PER_LAYER = {"moe.router.gate.weight": "mlp.gate.weight"}
_EXPERT_BIAS = {"moe.router.expert_bias": "mlp.gate.e_score_correction_bias"}
_SHARED_EXPERTS = {f"moe.shared.{ours}.weight": f"mlp.shared_experts.{theirs}.weight"
                   for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}
_EXPERTS = {
    "moe.experts.w1": "gate_proj.weight",
    "moe.experts.w2": "down_proj.weight",
    "moe.experts.w3": "up_proj.weight",
}
"""Stacked expert weights ``(experts, out, in)`` → the name of each expert's slice in a Hugging Face
file (``mlp.experts.{e}.<name>``; the slices are in ``nn.Linear``'s layout, as ours)."""
_EXPERT_PART = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_QKV_BIASES = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _translate(name: str, top: Mapping[str, str], per_layer: Mapping[str, str], layer: re.Pattern[str],
               prefix: str) -> str | None:
    if name in top:
        return top[name]
    match = layer.match(name)
    if match and match.group(2) in per_layer:
        return f"{prefix}{match.group(1)}.{per_layer[match.group(2)]}"
    return None


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------

_SIZE_FIELDS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"),
                ("intermediate_size", "ffn_hidden_dim"), ("vocab_size", "vocab_size"))
"""``config.json``'s size fields → the args attribute each must equal, in the order they are checked."""

OFF_FIELDS: dict[str, str] = {
    "attention_bias": "this model has no biases",
    "mlp_bias": "this model has no biases",
    "use_sliding_window": "this model attends to the whole sequence",
    "attention_dropout": "this model has no dropout",
}
"""``config.json`` fields of computation our decoder lacks → why a file that turns one on is refused
(a family names those its files carry: :attr:`DecoderHFAdapter.off_fields`)."""

_DEFAULT_ROPE_THETA = 10000.0
"""``transformers``' RoPE theta where a ``config.json`` has none."""


class RopeField(NamedTuple):
    """One setting of a RoPE scaling type: its key in ``rope_parameters``/``rope_scaling``, the
    args field that holds it, and how a file's value is read."""

    hf: str
    ours: str
    cast: Callable[[Any], Any] = float


class ConfigField(NamedTuple):
    """One setting of ``config.json`` beyond the decoder's (mixture of experts, latent attention):
    its keys (the first is written; any is
    read, e.g. transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``; none:
    the family's files never carry it and it must equal ``default``), the args field, how a
    file's value is read, and ``transformers``' default where a file leaves it out."""

    hf: tuple[str, ...]
    ours: str
    cast: Callable[[Any], Any]
    default: Any


def tuple_of_ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value or ())


def _written(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, eq=False)
class DecoderHFAdapter:
    """A decoder family's Hugging Face adapter (the :class:`~torchtitan_lite.models.spec.HFAdapter`
    of its spec), configured by the family's data.

    The family's args class is read as the decoder reads it: ``dim``, ``n_layers``, ``n_heads``,
    ``n_kv_heads``/``kv_heads``, ``head_dim`` (a field when the family's head size is its own, else
    a property), ``ffn_hidden_dim``, ``vocab_size``, ``norm_eps``, ``rope_theta``, ``max_seq_len``,
    ``tie_word_embeddings``, the class constants ``qk_norm`` and ``qkv_bias`` (which optional
    tensors the model has) and, with :attr:`rope_scalings`, ``rope_scaling`` and its fields."""

    model_type: str
    """``config.json``'s ``model_type``."""
    architecture: str
    """``config.json``'s architecture (``<Name>ForCausalLM``; ``<Name>`` is the family's name in messages)."""
    args_cls: type
    """The family's args dataclass."""
    config_defaults: Mapping[str, Any]
    """What ``transformers``' config class assumes for fields a file may leave out:
    ``rms_norm_eps``, ``max_position_embeddings`` and, when ``head_dim`` is an args field,
    ``head_dim``."""
    off_fields: Mapping[str, Any] = field(default_factory=dict)
    """Fields of :data:`OFF_FIELDS` the family's files carry → the value written (off); a file
    that turns one on is refused."""
    head_dim_in_config: bool = True
    """``config.json`` has ``head_dim``."""
    rope_scalings: Mapping[str, tuple[RopeField, ...]] = field(default_factory=dict)
    """RoPE scaling types the family implements (``rope_type`` → its settings), held in the args
    as ``rope_scaling`` (the type's name, ``"none"`` unscaled) and the settings' fields. Empty:
    unscaled RoPE only (and no ``rope_scaling`` field)."""
    extra_fields: tuple[ConfigField, ...] = ()
    """The family's settings in ``config.json`` beyond the decoder's: its mixture of experts (the
    args then have ``num_experts`` and ``moe_layer(layer_id)``, see
    :func:`~torchtitan_lite.models.decoder.is_moe_layer`, and the MoE layers' tensors are named as
    Hugging Face's MoE decoders name them: ``mlp.gate``, ``mlp.experts.{e}.*``,
    ``mlp.shared_experts.*``, ``mlp.gate.e_score_correction_bias``), its attention's."""
    attention_names: Mapping[str, str] | None = None
    """Our per-layer attention names → Hugging Face's, for a family with an attention of its own
    (``args.attention_cls``); None: the decoder's (q/k/v/o projections, whose query and key rows
    are permuted between the RoPE layouts)."""
    attention_shapes: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    """With :attr:`attention_names`: per-layer Hugging Face attention suffix → shape for args."""
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    """Fixed entries the family's ``config.json`` carries (written, not checked)."""
    layers_beyond_ignored: bool = False
    """A file's layers past ``num_hidden_layers`` are not the model's and are skipped (DeepSeek-V3's
    multi-token-prediction layer, ``model.layers.<num_hidden_layers>.*``)."""
    build_args: Callable[[dict[str, Any]], Any] | None = None
    """Args from a file's fields in the args' names (``ffn_hidden_dim`` and ``n_kv_heads`` among
    them; ``ValueError`` when the shape cannot be expressed); default ``args_cls(**fields)``."""

    output_name = "output.weight"
    """Our name of the output projection (absent from files with tied embeddings)."""
    embedding_name = "tok_embeddings.weight"
    """Our name of the token embedding (what a tied output projection is loaded from)."""

    architectures: tuple[str, ...] = field(init=False)
    _per_layer: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.off_fields) - set(OFF_FIELDS))
        if unknown:
            raise ValueError(f"off_fields {unknown} are not among {sorted(OFF_FIELDS)}")
        needed = {"rms_norm_eps", "max_position_embeddings", *(("head_dim",) if self._head_dim_field else ())}
        if not needed <= set(self.config_defaults):
            raise ValueError(f"config_defaults lacks {sorted(needed - set(self.config_defaults))}")
        object.__setattr__(self, "architectures", (self.architecture,))
        attention = {k: v for k, v in _PER_LAYER.items() if k.startswith("attention.")}
        if self.attention_names is not None:
            attention = dict(self.attention_names)
        per_layer = {**attention, **{k: v for k, v in _PER_LAYER.items() if not k.startswith("attention.")},
                     **(_QK_NORMS if self.args_cls.qk_norm else {}),
                     **(_QKV_BIASES if self.args_cls.qkv_bias else {}),
                     **({**_MOE_PER_LAYER, **_EXPERT_BIAS, **_SHARED_EXPERTS} if self._moe else {})}
        object.__setattr__(self, "_per_layer", per_layer)

    @property
    def _moe(self) -> bool:
        """Whether the family's models have mixture-of-experts layers."""
        return "num_experts" in {f.name for f in dataclasses.fields(self.args_cls)}

    @property
    def _label(self) -> str:
        return self.architecture.removesuffix("ForCausalLM")

    @property
    def _head_dim_field(self) -> bool:
        return "head_dim" in {f.name for f in dataclasses.fields(self.args_cls)}

    # ---- names and layouts -------------------------------------------------------------------

    def to_hf_name(self, name: str) -> str:
        """Our parameter name → the Hugging Face name (``ValueError`` for an unknown name)."""
        found = _translate(name, _TOP_LEVEL, self._per_layer, _OURS, "model.layers.")
        if found is None:
            raise ValueError(f"{name!r} is not a parameter name of the {self._label} model")
        return found

    def from_hf_name(self, hf_name: str) -> str:
        """Hugging Face name → our parameter name (``ValueError`` for an unknown name)."""
        found = _translate(hf_name, {hf: ours for ours, hf in _TOP_LEVEL.items()},
                           {hf: ours for ours, hf in self._per_layer.items()}, _THEIRS, "layers.")
        if found is None:
            raise ValueError(f"{hf_name!r} is not a Hugging Face {self._label} parameter name")
        return found

    def hf_names(self, name: str, args: Any) -> list[str]:
        """The Hugging Face names our tensor ``name`` is stored under: one, or for stacked expert
        weights one per expert (slice ``e`` of dim 0 is the ``e``-th name)."""
        match = _OURS.match(name)
        if self._moe and match and match.group(2) in _EXPERTS:
            part = _EXPERTS[match.group(2)]
            return [f"model.layers.{match.group(1)}.mlp.experts.{e}.{part}" for e in range(args.num_experts)]
        return [self.to_hf_name(name)]

    def from_hf_part(self, hf_name: str) -> tuple[str, int | None]:
        """A Hugging Face name → our tensor's name and, for one expert's slice of stacked expert
        weights, the expert (else None); ``ValueError`` for an unknown name."""
        match = _EXPERT_PART.match(hf_name) if self._moe else None
        if match:
            ours = {part: name for name, part in _EXPERTS.items()}[f"{match.group(3)}.weight"]
            return f"layers.{match.group(1)}.{ours}", int(match.group(2))
        return self.from_hf_name(hf_name), None

    def ignored(self, hf_name: str, args: Any = None) -> bool:
        """Tensors some Hugging Face files carry that our decoders recompute (``rotary_emb.inv_freq``)
        and, with :attr:`layers_beyond_ignored` and ``args``, those of layers past the model's
        (DeepSeek-V3's multi-token-prediction layer, which transformers drops too)."""
        if _RECOMPUTED.search(hf_name):
            return True
        match = _THEIRS.match(hf_name) if self.layers_beyond_ignored and args is not None else None
        return bool(match) and int(match.group(1)) >= args.n_layers

    def expected_shapes(self, args: Any) -> dict[str, tuple[int, ...]]:
        """Hugging Face name → shape of every tensor a model with ``args`` needs, in file order
        (no ``lm_head.weight`` when the embeddings are tied)."""
        d, h = args.dim, args.ffn_hidden_dim
        q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
        per_layer = {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                     "self_attn.v_proj.weight": (kv, d)}
        if self.args_cls.qkv_bias:
            per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                              "self_attn.v_proj.bias": (kv,)})
        per_layer["self_attn.o_proj.weight"] = (d, q)
        if self.attention_shapes is not None:
            per_layer = self.attention_shapes(args)
        if self.args_cls.qk_norm:
            per_layer.update({"self_attn.q_norm.weight": (args.head_dim,), "self_attn.k_norm.weight": (args.head_dim,)})
        dense = {"mlp.gate_proj.weight": (h, d), "mlp.down_proj.weight": (d, h), "mlp.up_proj.weight": (h, d)}
        norms = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, d)}
        for i in range(args.n_layers):
            ffn = self._moe_shapes(args) if is_moe_layer(args, i) else dense
            for suffix, shape in {**per_layer, **ffn, **norms}.items():
                shapes[f"model.layers.{i}.{suffix}"] = shape
        shapes["model.norm.weight"] = (d,)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, d)
        return shapes

    @staticmethod
    def _moe_shapes(args: Any) -> dict[str, tuple[int, ...]]:
        """Per-layer Hugging Face suffix → shape of an MoE layer's tensors."""
        d, h, experts = args.dim, args.moe_hidden_dim, args.num_experts
        shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (experts, d)}
        if args.score_func == "sigmoid":
            shapes["mlp.gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            shapes.update({f"mlp.experts.{e}.gate_proj.weight": (h, d), f"mlp.experts.{e}.up_proj.weight": (h, d),
                           f"mlp.experts.{e}.down_proj.weight": (d, h)})
        if args.shared_hidden_dim:
            s = args.shared_hidden_dim
            shapes.update({"mlp.shared_experts.gate_proj.weight": (s, d), "mlp.shared_experts.up_proj.weight": (s, d),
                           "mlp.shared_experts.down_proj.weight": (d, s)})
        return shapes

    def row_permutation(self, name: str, args: Any, *, to_hf: bool) -> torch.Tensor | None:
        """Row indices ``idx`` with ``converted = w[idx]`` for our parameter ``name`` (``to_hf``:
        ours → Hugging Face, else back), or None when its rows stay in place: query/key rows (and
        biases) within each head, and the q/k norm weights (one head). A family's own attention
        (:attr:`attention_names`) keeps its rows in place."""
        if self.attention_names is not None and ".attention." in f".{name}":
            return None
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            heads = args.n_heads
        elif name.endswith(("attention.wk.weight", "attention.wk.bias")):
            heads = args.kv_heads
        elif name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            heads = 1
        else:
            return None
        return row_permutation(heads * args.head_dim, heads, to_hf=to_hf)

    # ---- config.json -------------------------------------------------------------------------

    def _rope_parameters(self, args: Any) -> dict[str, Any]:
        """``rope_parameters`` of a ``config.json`` (the current layout: theta inside)."""
        kind = args.rope_scaling if self.rope_scalings else "none"
        params: dict[str, Any] = {"rope_type": "default" if kind == "none" else kind, "rope_theta": args.rope_theta}
        if kind != "none":
            params.update({f.hf: getattr(args, f.ours) for f in self.rope_scalings[kind]})
        return params

    def config_for(self, args: Any, dtype: torch.dtype) -> dict[str, Any]:
        """A ``config.json`` for a model with ``args`` stored in ``dtype``: RoPE in the current
        layout (``rope_parameters``) and, for readers that predate it, as ``rope_theta`` and
        ``rope_scaling`` too (the same values)."""
        parameters = self._rope_parameters(args)
        config: dict[str, Any] = {
            "architectures": list(self.architectures), "model_type": self.model_type,
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads,
            "num_hidden_layers": args.n_layers,
        }
        if self.head_dim_in_config:
            config["head_dim"] = args.head_dim
        legacy = {k: v for k, v in parameters.items() if k != "rope_theta"}
        config.update({
            "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "rope_parameters": parameters,
            "rope_theta": args.rope_theta, "rope_scaling": None if parameters["rope_type"] == "default" else legacy,
            "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, **self.off_fields,
            "tie_word_embeddings": args.tie_word_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
        })
        config.update({f.hf[0]: _written(getattr(args, f.ours)) for f in self.extra_fields if f.hf})
        config.update(self.extra_config)
        return config

    def _unsupported(self, config: Mapping[str, Any]) -> str | None:
        """The field that says a file is of another family or asks for computation this model
        lacks, as a phrase, or None."""
        found = config.get("model_type")
        if found is not None and found != self.model_type:
            return f"{CONFIG_FILE} has model_type={found!r} but this model is {self.model_type!r} ({self.architecture})"
        architectures = config.get("architectures")
        if isinstance(architectures, list) and architectures and self.architecture not in architectures:
            return f"{CONFIG_FILE} has architectures={architectures!r} but this model is {self.architecture}"
        if config.get("hidden_act", "silu") != "silu":
            return f"{CONFIG_FILE} has hidden_act={config['hidden_act']!r} but this model uses 'silu'"
        for name, off in self.off_fields.items():
            if config.get(name):
                shown = "true" if isinstance(off, bool) else repr(config[name])
                return f"{CONFIG_FILE} has {name}={shown} but {OFF_FIELDS[name]}"
        return None

    def _rope_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The RoPE fields of a ``config.json`` in the args' names (:func:`merged_rope_parameters`;
        ``rope_theta`` as the file has it). ``ValueError`` for a RoPE type the family does not
        implement (``yarn``, ``dynamic``, ``longrope``…) or a malformed entry."""
        parameters, where = merged_rope_parameters(config)
        kind = parameters.get("rope_type", parameters.get("type")) or "default"
        if kind != "default" and kind not in self.rope_scalings:
            if not self.rope_scalings:
                raise ValueError(f"{CONFIG_FILE} has {where}.rope_type={kind!r}; {self.architecture} here "
                                 "supports only default RoPE")
            raise ValueError(f"{CONFIG_FILE} has {where}.rope_type={kind!r}; supported RoPE types: "
                             f"{', '.join(['default', *self.rope_scalings])}")
        fields: dict[str, Any] = {}
        if parameters.get("rope_theta") is not None:
            fields["rope_theta"] = parameters["rope_theta"]
        if self.rope_scalings:
            fields["rope_scaling"] = "none" if kind == "default" else kind
        if kind != "default":
            try:
                fields.update({f.ours: f.cast(parameters[f.hf]) for f in self.rope_scalings[kind]})
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{CONFIG_FILE} {where} of type {kind!r} lacks a usable field: {exc}") from None
        return fields

    def config_mismatch(self, config: Mapping[str, Any], args: Any) -> str | None:
        """The first field of ``config`` that asks for computation this model lacks or disagrees
        with ``args``, as a phrase, or None."""
        problem = self._unsupported(config)
        if problem is not None:
            return problem
        try:
            rope = self._rope_fields(config)
        except ValueError as exc:
            return str(exc)
        sizes = {name: config.get(name) for name, _ in _SIZE_FIELDS}
        if sizes["num_key_value_heads"] is None:  # absent: as many as the query heads
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
        exact = [(name, sizes[name], getattr(args, attr)) for name, attr in _SIZE_FIELDS]
        exact.append(("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), args.tie_word_embeddings))
        for name, value, want in exact:
            if value is not None and value != want:
                return f"{CONFIG_FILE} has {name}={value!r} but this model has {name}={want!r}"
        try:
            moe = self._moe_settings(config)
        except ValueError as exc:
            return str(exc)
        for f in self.extra_fields:
            value, want = moe[f.ours], getattr(args, f.ours)
            if value != want and not (isinstance(want, float) and math.isclose(value, want, rel_tol=1e-6)):
                key = next((k for k in f.hf if config.get(k) is not None), None)
                where = (
                    f"{CONFIG_FILE} has {key}={config[key]!r}" if key else f"{self.architecture} has {f.ours}={value!r}"
                )
                return f"{where} but this model has {f.ours}={want!r}"
        numbers = [("rms_norm_eps", config.get("rms_norm_eps"), args.norm_eps),
                   ("rope_theta", rope.get("rope_theta"), args.rope_theta)]
        if self.rope_scalings:
            if rope["rope_scaling"] != args.rope_scaling:
                return (f"{CONFIG_FILE} has RoPE scaling {rope['rope_scaling']!r} but this model has "
                        f"rope_scaling={args.rope_scaling!r}")
            numbers += [(f.ours, rope.get(f.ours), getattr(args, f.ours))
                        for f in self.rope_scalings.get(args.rope_scaling, ())]
        for name, value, want in numbers:
            if value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isclose(value, want, rel_tol=1e-6):
                return f"{CONFIG_FILE} has {name}={value!r} but this model has {name}={want!r}"
        return None

    def _moe_settings(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The mixture-of-experts settings of a ``config.json`` in the args' names (defaults for
        keys it leaves out); ``ValueError`` for a value that cannot be read."""
        settings = {}
        for f in self.extra_fields:
            key = next((k for k in f.hf if config.get(k) is not None), None)
            try:
                settings[f.ours] = f.default if key is None else f.cast(config[key])
            except (TypeError, ValueError):
                raise ValueError(f"{CONFIG_FILE} has {key}={config[key]!r}, which is not a usable "
                                 f"{f.ours}") from None
        return settings

    def args_from_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        """The family's args for a ``config.json`` of any size (``ValueError``, one line, for
        another family, computation this model lacks or a shape the args cannot express);
        defaults as ``transformers``' config class has them (:attr:`config_defaults`);
        ``overrides`` replace fields. The result is checked against the whole file
        (:meth:`config_mismatch`)."""
        problem = self._unsupported(config)
        if problem is not None:
            raise ValueError(problem)
        rope = self._rope_fields(config)
        defaults = self.config_defaults
        try:
            n_heads = int(config["num_attention_heads"])
            fields: dict[str, Any] = {
                "dim": int(config["hidden_size"]), "n_layers": int(config["num_hidden_layers"]), "n_heads": n_heads,
                "n_kv_heads": int(config.get("num_key_value_heads") or n_heads),
                "ffn_hidden_dim": int(config["intermediate_size"]), "vocab_size": int(config["vocab_size"]),
                "norm_eps": float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
                "max_seq_len": int(config.get("max_position_embeddings", defaults["max_position_embeddings"])),
                "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
                **rope, "rope_theta": float(rope.get("rope_theta") or _DEFAULT_ROPE_THETA),
            }
            if self._head_dim_field:  # a head size of the family's own
                fields["head_dim"] = int(config.get("head_dim") or defaults["head_dim"])
            fields.update(self._moe_settings(config))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{CONFIG_FILE} lacks a usable {self.architecture} field: {exc}") from None
        fields.update(overrides)
        args = self.args_cls(**fields) if self.build_args is None else self.build_args(fields)
        problem = self.config_mismatch(config, args)
        if problem is not None:
            raise ValueError(problem)
        return args
