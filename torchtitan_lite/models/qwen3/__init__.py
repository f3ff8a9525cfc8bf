"""The Qwen3 dense family: shapes (:mod:`.model`), Hugging Face adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torchtitan_lite.models.decoder import decoder_fsdp_units
from torchtitan_lite.models.qwen3.hf import ADAPTER
from torchtitan_lite.models.qwen3.model import QWEN3_FLAVORS, Qwen3, Qwen3Args
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["QWEN3_FLAVORS", "QWEN3_SPEC", "Qwen3", "Qwen3Args"]


QWEN3_SPEC = ModelSpec(name="qwen3", model_cls=Qwen3, args_cls=Qwen3Args, flavors=QWEN3_FLAVORS,
                       fsdp_units=decoder_fsdp_units, hf=ADAPTER, parallel_dims=frozenset({"tp", "cp", "pp"}))
