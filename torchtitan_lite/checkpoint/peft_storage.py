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
from torchtitan_lite.distributed.lora import (
    ADAPTERS,
    EXPERTS_TARGET,
    LoRASetup,
    lora_expert_modules,
    lora_modules,
)
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


_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
"""The experts' parameters PEFT adapts in a transformers 5 MoE model (``target_parameters``): the
gate and up projections fused as ``gate_up_proj`` ``(experts, 2 × hidden, dim)`` (gate first), and
``down_proj`` ``(experts, dim, hidden)``. PEFT nests its wrappers in that order: the gate/up
adapters sit under ``mlp.experts.base_layer``, the down adapters under ``mlp.experts``."""


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def adapter_config(lora: LoRASetup, *, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``lora`` (PEFT's ``LoraConfig`` fields). With the experts
    adapted: ``target_parameters`` names their fused gate/up and down parameters, and the fused
    gate/up adapter has twice the rank (our gate and up adapters side by side) and twice alpha
    (the same scale)."""
    linears = sorted(t for t in lora.target_modules if t != EXPERTS_TARGET)
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": lora.rank, "lora_alpha": _number(lora.alpha),
        "lora_dropout": lora.dropout, "target_modules": linears or None, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    if lora.experts:
        config.update(target_parameters=[_GATE_UP, _DOWN], rank_pattern={_GATE_UP: 2 * lora.rank},
                      alpha_pattern={_GATE_UP: _number(2 * lora.alpha)})
    return config


def _expert_keys(model: nn.Module, spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """Adapted expert module → the PEFT key prefixes of its fused gate/up and its down adapters."""
    adapter, args = _adapter(spec), model.args
    keys = {}
    for name in lora_expert_modules(model):
        path = adapter.hf_names(f"{name}.w1", args)[0].rsplit(".", 3)[0]  # model.layers.N.mlp.experts
        keys[name] = (f"{PEFT_PREFIX}{path}.base_layer", f"{PEFT_PREFIX}{path}")
    return keys


def _experts_to_peft(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our per-expert adapters (``a[w]`` ``(E, r, in)``, ``b[w]`` ``(E, out, r)`` for w1 gate, w3
    up, w2 down) → PEFT's ``lora_A`` ``(r·E, in)`` and ``lora_B`` ``(out, r·E)`` (its expert e's
    factors: ``A.view(E, r, in)[e]`` and ``B.view(out, r, E)[..., e]``), the gate and up adapters
    as one of rank 2r on the fused gate/up weight (A stacked, B block-diagonal)."""
    experts, hidden, rank = b["w1"].shape
    fused_b = b["w1"].new_zeros(experts, 2 * hidden, 2 * rank)
    fused_b[:, :hidden, :rank], fused_b[:, hidden:, rank:] = b["w1"], b["w3"]
    fused_a = torch.cat([a["w1"], a["w3"]], dim=1)
    return {"gate_up.lora_A": fused_a.reshape(-1, fused_a.shape[-1]),
            "gate_up.lora_B": fused_b.permute(1, 2, 0).reshape(2 * hidden, -1),
            "down.lora_A": a["w2"].reshape(-1, a["w2"].shape[-1]),
            "down.lora_B": b["w2"].permute(1, 2, 0).reshape(b["w2"].shape[1], -1)}


def _experts_from_peft(tensors: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_experts_to_peft`: ``w1.lora_A`` … ``w2.lora_B`` in our layout;
    ``ValueError`` when the fused gate/up B's off-diagonal blocks (zero in what we write) are not."""
    fused_a = tensors["gate_up.lora_A"].reshape(experts, -1, tensors["gate_up.lora_A"].shape[-1])
    fused_b = tensors["gate_up.lora_B"].reshape(tensors["gate_up.lora_B"].shape[0], -1, experts).permute(2, 0, 1)
    rank, hidden = fused_a.shape[1] // 2, fused_b.shape[1] // 2
    if fused_b[:, :hidden, rank:].any() or fused_b[:, hidden:, :rank].any():
        raise ValueError("its fused gate/up adapter mixes the gate and up projections (not one we wrote), which "
                         "separate gate and up adapters cannot express")
    down_b = tensors["down.lora_B"]
    return {"w1.lora_A": fused_a[:, :rank], "w3.lora_A": fused_a[:, rank:],
            "w1.lora_B": fused_b[:, :hidden, :rank], "w3.lora_B": fused_b[:, hidden:, rank:],
            "w2.lora_A": tensors["down.lora_A"].reshape(experts, -1, tensors["down.lora_A"].shape[-1]),
            "w2.lora_B": down_b.reshape(down_b.shape[0], -1, experts).permute(2, 0, 1)}


_PEFT_PARTS = {"gate_up.lora_A": (0, "lora_A"), "gate_up.lora_B": (0, "lora_B"),
               "down.lora_A": (1, "lora_A"), "down.lora_B": (1, "lora_B")}
"""Our part name → (which key prefix of :func:`_expert_keys`, PEFT's adapter name)."""


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
    for name, prefixes in _expert_keys(model, spec).items():
        module = dict(model.named_modules())[name]
        a = {w: _full(getattr(module, f"lora_{w}").lora_A) for w in module.stacked_weights}
        b = {w: _full(getattr(module, f"lora_{w}").lora_B) for w in module.stacked_weights}
        for part, full in _experts_to_peft(a, b).items():
            which, adapter_name = _PEFT_PARTS[part]
            tensors[f"{prefixes[which]}.{adapter_name}.weight"] = full.to(dtype or full.dtype).cpu().contiguous()
    if is_distributed() and getattr(model, "pipeline_stages", None) is not None:
        # Pipeline parallel: each rank holds its stages' adapters; rank 0 writes them all (the
        # data-parallel ranks of a stage send the same ones: the adapters are small)
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(tensors, parts if dist.get_rank() == 0 else None, dst=0)
        tensors = {key: value for part in parts for key, value in part.items()}
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
    expert_keys = {f"{prefixes[which]}.{adapter_name}.weight": (name, part)
                   for name, prefixes in _expert_keys(model, spec).items()
                   for part, (which, adapter_name) in _PEFT_PARTS.items()}
    try:
        with safe_open(str(file), framework="pt") as fh:
            keys = set(fh.keys())
            wanted = [*names.values(), *expert_keys]
            missing = [key for key in wanted if key not in keys]
            extra = sorted(keys - set(wanted))
            if missing or extra:
                what = (
                    f"has no tensor {missing[0]!r}"
                    if missing
                    else f"has tensor {extra[0]!r}, which no adapter here has"
                )
                raise CheckpointError(f"PEFT adapter {str(path)!r} {what} (written for other linears or another model)")
            loaded = {name: fh.get_tensor(key) for name, key in names.items()}
            expert_parts: dict[str, dict[str, torch.Tensor]] = {}
            for key, (name, part) in expert_keys.items():
                expert_parts.setdefault(name, {})[part] = fh.get_tensor(key)
    except CheckpointError:
        raise
    except Exception as exc:  # a missing or unreadable file, whatever the library raises
        raise CheckpointError(f"PEFT adapter {str(path)!r} cannot be read: {failure_reason(exc)}") from None
    reshard_all(model)
    params = dict(model.named_parameters())
    for name, parts in expert_parts.items():
        experts = params[f"{name}.lora_w1.lora_A"].shape[0]
        try:
            ours = _experts_from_peft(parts, experts)
        except (RuntimeError, ValueError) as exc:  # written for another shape or rank, or by PEFT itself
            raise CheckpointError(f"PEFT adapter {str(path)!r}: the experts' adapters of {name!r} do not fit this "
                                  f"model ({failure_reason(exc)})") from None
        loaded.update({f"{name}.lora_{key}": value for key, value in ours.items()})
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
