"""The DeepSeek-V3 family: shapes (:mod:`.model`), latent attention (:mod:`.attention`), Hugging Face
adapter (:mod:`.hf`) and its spec."""

from __future__ import annotations

from torchtitan_lite.models.decoder import decoder_fsdp_units
from torchtitan_lite.models.deepseek_v3.hf import ADAPTER
from torchtitan_lite.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS, DeepseekV3, DeepseekV3Args
from torchtitan_lite.models.spec import ModelSpec

__all__ = ["DEEPSEEK_V3_FLAVORS", "DEEPSEEK_V3_SPEC", "DeepseekV3", "DeepseekV3Args"]


DEEPSEEK_V3_SPEC = ModelSpec(name="deepseek_v3", model_cls=DeepseekV3, args_cls=DeepseekV3Args,
                             flavors=DEEPSEEK_V3_FLAVORS, fsdp_units=decoder_fsdp_units, hf=ADAPTER,
                             parallel_dims=frozenset({"ep", "tp", "cp", "pp"}))
