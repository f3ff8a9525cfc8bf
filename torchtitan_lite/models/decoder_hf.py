"""Hugging Face layouts our decoder families share: the RoPE row permutation and parameter
name maps. Each family's adapter (``models/<family>/hf.py``) builds on these.

**RoPE.** Our decoder (like Meta's reference) rotates interleaved pairs ``(x[2i], x[2i+1])`` of
each head; Hugging Face's implementations rotate halves (``rotate_half``). Query and key weights
(and per-head q/k norm weights) are the same up to a permutation of rows within each head:
:func:`permute_for_hf` and :func:`unpermute_from_hf`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DECODER_PER_LAYER", "DECODER_TOP_LEVEL", "NameMap", "decoder_shapes", "family_mismatch",
           "ignored_hf_name", "merged_rope_parameters", "permute_for_hf", "row_permutation", "unpermute_from_hf"]


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


DECODER_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""Our top-level parameter names → Hugging Face's, the same for every decoder family."""
DECODER_PER_LAYER = {
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
"""Per-layer suffixes every decoder family has (a family adds its own: q/k norms, biases)."""
_RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def ignored_hf_name(hf_name: str) -> bool:
    """Tensors some Hugging Face files carry that our decoders recompute (``rotary_emb.inv_freq``)."""
    return bool(_RECOMPUTED.search(hf_name))


def family_mismatch(config: Mapping[str, Any], model_type: str, architecture: str) -> str | None:
    """The ``config.json`` field that says the file is of another family than ``model_type`` /
    ``architecture``, as a phrase, or None."""
    found = config.get("model_type")
    if found is not None and found != model_type:
        return f"config.json has model_type={found!r} but this model is {model_type!r} ({architecture})"
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and architecture not in architectures:
        return f"config.json has architectures={architectures!r} but this model is {architecture}"
    return None


class NameMap:
    """Our parameter names ↔ Hugging Face names: fixed top-level names and per-layer suffixes
    under ``layers.N.`` (ours) and ``model.layers.N.`` (theirs)."""

    _OURS = (re.compile(r"^layers\.(\d+)\.(.+)$"), "model.layers.")
    _THEIRS = (re.compile(r"^model\.layers\.(\d+)\.(.+)$"), "layers.")

    def __init__(self, family: str, top_level: Mapping[str, str], per_layer: Mapping[str, str]) -> None:
        self.family = family
        self._to_hf = (dict(top_level), dict(per_layer))
        self._from_hf = ({hf: ours for ours, hf in top_level.items()}, {hf: ours for ours, hf in per_layer.items()})

    @staticmethod
    def _translate(name: str, tables: tuple[dict[str, str], dict[str, str]],
                   layer: tuple[re.Pattern[str], str]) -> str | None:
        top, per_layer = tables
        if name in top:
            return top[name]
        match = layer[0].match(name)
        if match and match.group(2) in per_layer:
            return f"{layer[1]}{match.group(1)}.{per_layer[match.group(2)]}"
        return None

    def to_hf(self, name: str) -> str:
        """Our parameter name → the Hugging Face name (``ValueError`` for an unknown name)."""
        found = self._translate(name, self._to_hf, self._OURS)
        if found is None:
            raise ValueError(f"{name!r} is not a parameter name of the {self.family} model")
        return found

    def from_hf(self, name: str) -> str:
        """Hugging Face name → our parameter name (``ValueError`` for an unknown name)."""
        found = self._translate(name, self._from_hf, self._THEIRS)
        if found is None:
            raise ValueError(f"{name!r} is not a Hugging Face {self.family} parameter name")
        return found


def decoder_shapes(args: Any, per_layer: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Hugging Face name → shape of a decoder's tensors in file order: the embedding, the
    ``per_layer`` suffixes under ``model.layers.N.``, the final norm, and ``lm_head.weight``
    unless the embeddings are tied."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    shapes["model.norm.weight"] = (args.dim,)
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, args.dim)
    return shapes
