"""The Qwen2 / Qwen2.5 dense family: shapes (:mod:`.model`), Hugging Face adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torchtitan_lite.models.decoder import decoder_fsdp_units
from torchtitan_lite.models.qwen2.hf import ADAPTER
from torchtitan_lite.models.qwen2.model import QWEN2_FLAVORS, Qwen2, Qwen2Args
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["QWEN2_FLAVORS", "QWEN2_SPEC", "Qwen2", "Qwen2Args"]

QWEN2_SPEC = ModelSpec(name="qwen2", model_cls=Qwen2, args_cls=Qwen2Args, flavors=QWEN2_FLAVORS,
                       fsdp_units=decoder_fsdp_units, hf=ADAPTER, parallel_dims=frozenset({"tp", "cp", "pp"}))
