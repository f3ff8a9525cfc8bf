"""PEFT adapter folders: a LoRA model's adapters as ``peft.PeftModel.from_pretrained`` reads them.

A folder holds ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules`` …) and ``adapter_model.safetensors`` with PEFT's names:
``base_model.model.`` + the Hugging Face name of the adapted linear + ``.lora_A.weight`` /
``.lora_B.weight`` (e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
The Hugging Face names, and the row order of the query/key projections (``lora_B``'s rows are
the output rows of the weight it adapts, which Hugging Face orders by its RoPE layout), come
from the family's adapter (:mod:`torchtitan_lite.models.decoder_hf`). The base weights are not
in the folder: PEFT applies it to the base model it is given.

Works on plain and FSDP2-sharded models: the adapters are small (rank × (in + out) per linear),
so each is gathered whole, one at a time, and rank 0 writes the file. Only safetensors and JSON
are read back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_lite.checkpoint.hf_storage import barrier_if_distributed, copy_full_into, is_distributed
from torchtitan_lite.checkpoint.safe_reading import failure_reason
from torchtitan_lite.distributed.fsdp import reshard_all
from torchtitan_lite.distributed.lora import ADAPTERS, LoRASetup, lora_modules
from torchtitan_lite.errors import CheckpointError
from torchtitan_lite.models.spec import HFAdapter, ModelSpec

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "PEFT_PREFIX", "adapter_config", "load_peft_adapter",
           "peft_adapter_names", "save_peft_adapter"]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModelForCausalLM`` puts before the base model's parameter names."""


def _adapter(spec: ModelSpec) -> HFAdapter:
    if spec.hf is None:
        raise CheckpointError(f"model.name {spec.name!r} has no Hugging Face names, which a PEFT adapter "
                              "folder needs")
    return spec.hf


def peft_adapter_names(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """Our adapter parameter name → its key in ``adapter_model.safetensors``
    (``layers.0.attention.wq.lora_A.weight`` → ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    adapter = _adapter(spec)
    names = {}
    for name in lora_modules(model):
        hf = adapter.to_hf_name(f"{name}.weight").removesuffix(".weight")
        for which in ADAPTERS:
            names[f"{name}.{which}.weight"] = f"{PEFT_PREFIX}{hf}.{which}.weight"
    return names


def adapter_config(lora: LoRASetup, *, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``lora`` (PEFT's ``LoraConfig`` fields)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": lora.rank, "lora_alpha": alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(lora.target_modules), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


@torch.no_grad()
def save_peft_adapter(model: nn.Module, path: str | Path, *, spec: ModelSpec, lora: LoRASetup,
                      dtype: torch.dtype | None = None, base_model_name_or_path: str | None = None) -> None:
    """Write ``model``'s LoRA adapters (sharded or not) as a PEFT adapter folder at ``path``, in
    ``dtype`` (default: the adapters' own). Collective when the model is sharded (every rank
    gathers each adapter; rank 0 writes). The caller handles writing to a temporary folder and
    renaming it."""
    from safetensors.torch import save_file

    path = Path(path)
    adapter = _adapter(spec)
    args = model.args
    reshard_all(model)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, key in peft_adapter_names(model, spec).items():
        full = _full(params[name])
        if name.endswith("lora_B.weight"):  # its rows are the adapted weight's output rows
            index = adapter.row_permutation(name.removesuffix("lora_B.weight") + "weight", args, to_hf=True)
            if index is not None:
                full = full.index_select(0, index.to(full.device))
        tensors[key] = full.to(dtype or full.dtype).cpu().contiguous()
    if not is_distributed() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        config = adapter_config(lora, base_model_name_or_path=base_model_name_or_path)
        (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    barrier_if_distributed()


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str | Path, *, spec: ModelSpec) -> None:
    """Fill ``model``'s LoRA adapters (sharded or not) from a PEFT adapter folder written for
    the same linears and rank (:func:`save_peft_adapter`); every rank reads the (small) file and
    keeps its own rows. A missing, extra or misshapen tensor is one :class:`CheckpointError`
    line naming the folder."""
    from safetensors import safe_open

    path = Path(path)
    adapter = _adapter(spec)
    args = model.args
    file = path / ADAPTER_WEIGHTS_FILE
    names = peft_adapter_names(model, spec)
    try:
        with safe_open(str(file), framework="pt") as fh:
            keys = set(fh.keys())
            missing = [key for key in names.values() if key not in keys]
            extra = sorted(keys - set(names.values()))
            if missing or extra:
                what = f"has no tensor {missing[0]!r}" if missing else f"has tensor {extra[0]!r}, which no adapter here has"
                raise CheckpointError(f"PEFT adapter {str(path)!r} {what} (written for other linears or another model)")
            loaded = {name: fh.get_tensor(key) for name, key in names.items()}
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable file, whatever the library raises
        raise CheckpointError(f"PEFT adapter {str(path)!r} cannot be read: {failure_reason(exc)}") from None
    reshard_all(model)
    params = dict(model.named_parameters())
    for name, full in loaded.items():
        param = params[name]
        if tuple(full.shape) != tuple(param.shape):
            raise CheckpointError(f"PEFT adapter {str(path)!r}: {names[name]!r} has shape {list(full.shape)} but "
                                  f"this model's adapter has {list(param.shape)} (another lora.rank?)")
        if name.endswith("lora_B.weight"):
            index = adapter.row_permutation(name.removesuffix("lora_B.weight") + "weight", args, to_hf=False)
            if index is not None:
                full = full.index_select(0, index)
        copy_full_into(param, full)
