"""Model registry: ``[model] name`` picks a family's :class:`~torchtitan_lite.models.spec.ModelSpec`,
``[model] flavor`` one of its shapes. Our families are registered on import; a model of one's own
joins them with :func:`register_model_spec` (before the job is loaded) and trains through the same
entry point."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torchtitan_lite.errors import ConfigError
from torchtitan_lite.models.deepseek_v3 import DEEPSEEK_V3_SPEC
from torchtitan_lite.models.llama3 import LLAMA3_SPEC
from torchtitan_lite.models.qwen2 import QWEN2_SPEC
from torchtitan_lite.models.qwen3 import QWEN3_SPEC
from torchtitan_lite.models.qwen3_moe import QWEN3_MOE_SPEC
from torchtitan_lite.models.spec import DecoderArgs, ModelSpec

__all__ = ["MODEL_SPECS", "ModelSpec", "family_hint", "family_of", "get_model_spec", "register_model_spec"]

MODEL_SPECS: dict[str, ModelSpec] = {}
"""``model.name`` → the registered spec, in registration order."""

_ARGS_METHODS = ("num_params", "flops_per_token", "attention_flops_per_token")


def _problems(spec: object) -> list[str]:
    """What makes ``spec`` unusable by the framework (see :mod:`torchtitan_lite.models.spec`)."""
    if not isinstance(spec, ModelSpec):
        return [f"expected a ModelSpec, got {type(spec).__name__}"]
    problems = []
    if not isinstance(spec.name, str) or not spec.name.strip() or spec.name != spec.name.strip():
        problems.append(f"name {spec.name!r} must be a non-empty string without surrounding spaces")
    for attribute in ("model_cls", "fsdp_units"):
        if not callable(getattr(spec, attribute)):
            problems.append(f"{attribute} must be callable")
    args_cls = spec.args_cls
    if not (isinstance(args_cls, type) and dataclasses.is_dataclass(args_cls)):
        problems.append(f"args_cls {getattr(args_cls, '__name__', repr(args_cls))} must be a dataclass")
    elif not issubclass(args_cls, DecoderArgs):
        problems.append(f"args_cls {args_cls.__name__} must derive from torchtitan_lite.models.spec.DecoderArgs "
                        "(what every family declares: num_experts, tie_word_embeddings)")
    else:
        fields = {f.name for f in dataclasses.fields(args_cls)}
        missing = [name for name in ("vocab_size", "max_seq_len") if name not in fields]
        missing += [f"{name}()" for name in _ARGS_METHODS if not callable(getattr(args_cls, name, None))]
        if missing:
            problems.append(f"args_cls {args_cls.__name__} lacks {', '.join(missing)}")
    if not isinstance(spec.flavors, Mapping) or not spec.flavors:
        problems.append("flavors must be a non-empty mapping of flavor name to args")
    elif isinstance(args_cls, type):
        wrong = [name for name, args in spec.flavors.items() if not isinstance(args, args_cls)]
        if wrong:
            problems.append(f"flavors {', '.join(map(repr, wrong))} are not {args_cls.__name__} instances")
    return problems


def register_model_spec(spec: ModelSpec, *, replace: bool = False) -> None:
    """Make ``spec`` the family ``model.name = spec.name`` picks (for every later job of this
    process). ``ValueError``, one line, for a spec the framework cannot use (not a
    :class:`ModelSpec`, no flavors, args without what the framework reads) or a name that is
    registered already, unless ``replace``."""
    problems = _problems(spec)
    if problems:
        raise ValueError(f"register_model_spec: {'; '.join(problems)}")
    if spec.name in MODEL_SPECS and not replace:
        raise ValueError(f"register_model_spec: model {spec.name!r} is registered already "
                         "(pass replace=True to replace it)")
    MODEL_SPECS[spec.name] = spec


for _spec in (LLAMA3_SPEC, QWEN3_SPEC, QWEN2_SPEC, QWEN3_MOE_SPEC, DEEPSEEK_V3_SPEC):
    register_model_spec(_spec)


def get_model_spec(name: str) -> ModelSpec:
    """The registered family ``name`` (:class:`ConfigError` naming ``model.name`` otherwise)."""
    if name not in MODEL_SPECS:
        raise ConfigError(f"model.name: invalid value {name!r}; expected one of "
                          f"{', '.join(map(repr, MODEL_SPECS))}")
    return MODEL_SPECS[name]


def family_of(config: object) -> str | None:
    """The registered family whose Hugging Face ``model_type`` a ``config.json`` dict has."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return next(
        (spec.name for spec in MODEL_SPECS.values() if spec.hf is not None and model_type == spec.hf.model_type), None
    )


def family_hint(config: object, spec: ModelSpec) -> str:
    """`` (model.name = 'qwen3' reads it)`` when a ``config.json`` dict is of another registered
    family than ``spec``, else empty."""
    family = family_of(config)
    return f" (model.name = {family!r} reads it)" if family not in (None, spec.name) else ""
