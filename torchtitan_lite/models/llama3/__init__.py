"""The Llama 3 family: model (:mod:`.model`), Hugging Face adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torchtitan_lite.models.decoder import decoder_fsdp_units
from torchtitan_lite.models.llama3.hf import ADAPTER
from torchtitan_lite.models.llama3.model import LLAMA3_FLAVORS, ModelArgs, Transformer
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["LLAMA3_FLAVORS", "LLAMA3_SPEC", "ModelArgs", "Transformer"]


LLAMA3_SPEC = ModelSpec(name="llama3", model_cls=Transformer, args_cls=ModelArgs, flavors=LLAMA3_FLAVORS,
                        fsdp_units=decoder_fsdp_units, hf=ADAPTER, parallel_dims=frozenset({"tp", "cp", "pp"}))
