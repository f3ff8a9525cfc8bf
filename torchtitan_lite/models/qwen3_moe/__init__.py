"""The Qwen3-MoE family: shapes (:mod:`.model`), Hugging Face adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torchtitan_lite.models.decoder import decoder_fsdp_units
from torchtitan_lite.models.qwen3_moe.hf import ADAPTER
from torchtitan_lite.models.qwen3_moe.model import QWEN3_MOE_FLAVORS, Qwen3Moe, Qwen3MoeArgs
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["QWEN3_MOE_FLAVORS", "QWEN3_MOE_SPEC", "Qwen3Moe", "Qwen3MoeArgs"]


QWEN3_MOE_SPEC = ModelSpec(name="qwen3_moe", model_cls=Qwen3Moe, args_cls=Qwen3MoeArgs, flavors=QWEN3_MOE_FLAVORS,
                           fsdp_units=decoder_fsdp_units, hf=ADAPTER,
                           parallel_dims=frozenset({"ep", "tp", "cp", "pp"}))
