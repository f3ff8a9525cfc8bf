"""The Llama 3 family: model (:mod:`.model`), Hugging Face adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torch import nn

from torchtitan_lite.models.llama3.hf import ADAPTER
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS, ModelArgs, Transformer
from torchtitan_lite.models.spec import FSDPLayout, ModelSpec

__all__ = ["LLAMA3_FLAVORS", "LLAMA3_SPEC", "ModelArgs", "Transformer"]


def fsdp_units(model: nn.Module) -> FSDPLayout:
    """Token embedding, each block, then final norm and output projection as one unit. With
    tied embeddings the embedding and the output projection (one parameter) are one unit, and
    the final norm a unit of its own."""
    assert isinstance(model, Transformer)
    blocks = list(model.layers.values())
    if model.args.tie_word_embeddings:
        return FSDPLayout(first_unit=[model.tok_embeddings, model.output], blocks=blocks, last_unit=model.norm)
    return FSDPLayout(first_unit=model.tok_embeddings, blocks=blocks, last_unit=[model.norm, model.output])


LLAMA3_SPEC = ModelSpec(name="llama3", model_cls=Transformer, args_cls=ModelArgs, flavors=LLAMA3_FLAVORS,
                        fsdp_units=fsdp_units, hf=ADAPTER)
