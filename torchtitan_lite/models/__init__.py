"""Model registry: ``[model] name`` picks a model family, ``[model] flavor`` its shape."""

from __future__ import annotations

from torchtitan_lite.models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer

__all__ = ["MODEL_REGISTRY", "ModelArgs", "Transformer"]

# name -> (model class, flavors)
MODEL_REGISTRY: dict[str, tuple[type[Transformer], dict[str, ModelArgs]]] = {
    "llama3": (Transformer, LLAMA3_FLAVORS),
}
