"""Model registry: ``[model] name`` picks a family's :class:`~torchtitan_lite.models.spec.ModelSpec`,
``[model] flavor`` one of its shapes."""

from __future__ import annotations

from torchtitan_lite.errors import ConfigError
from torchtitan_lite.models.llama3 import LLAMA3_SPEC
from torchtitan_lite.models.qwen2 import QWEN2_SPEC
from torchtitan_lite.models.qwen3 import QWEN3_SPEC
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["MODEL_SPECS", "ModelSpec", "family_hint", "family_of", "get_model_spec"]

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA3_SPEC, QWEN3_SPEC, QWEN2_SPEC)}


def get_model_spec(name: str) -> ModelSpec:
    """The registered family ``name`` (:class:`ConfigError` naming ``model.name`` otherwise)."""
    if name not in MODEL_SPECS:
        raise ConfigError(f"model.name: invalid value {name!r}; expected one of "
                          f"{', '.join(map(repr, MODEL_SPECS))}")
    return MODEL_SPECS[name]


def family_of(config: object) -> str | None:
    """The registered family whose Hugging Face ``model_type`` a ``config.json`` dict has."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return next((spec.name for spec in MODEL_SPECS.values() if spec.hf is not None and model_type == spec.hf.model_type),
                None)


def family_hint(config: object, spec: ModelSpec) -> str:
    """`` (model.name = 'qwen3' reads it)`` when a ``config.json`` dict is of another registered
    family than ``spec``, else empty."""
    family = family_of(config)
    return f" (model.name = {family!r} reads it)" if family not in (None, spec.name) else ""
