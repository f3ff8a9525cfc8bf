"""Low-rank adapters (LoRA) on any model's linear layers, applied from outside the model code.

:func:`apply_lora` gives each named ``nn.Linear`` two adapter matrices, ``lora_A`` (rank × in,
PEFT's kaiming-uniform init) and ``lora_B`` (out × rank, zeros), so that the layer computes

    y = W x + b + (alpha / rank) · B A dropout(x)

and freezes every other parameter of the model (``requires_grad = False``): only the adapters
get gradients and optimizer state. As activation checkpointing does, the layer's class is
replaced by a subclass (``LoRALinear``), with no wrapper module: the base weight keeps its name
(``layers.0.attention.wq.weight``: Hugging Face import, FSDP units and float8 filters are
unchanged) and the adapters sit below the layer under PEFT's names (``….wq.lora_A.weight``,
``….wq.lora_B.weight``). The model's class gets an ``init_weights`` that also initialises the
adapters (:func:`init_lora_weights`, shard-aware like :mod:`torchtitan_lite.models.init`: the
values do not depend on the sharding), so the meta-init path (``to_empty`` → ``init_weights``)
fills them; loading base weights afterwards (a Hugging Face folder) leaves them at their init.

Apply it to the model on the meta device before float8, activation checkpointing, compile and
``fully_shard`` (:func:`~.parallelize.build_sharded_model`): FSDP2 shards the adapters with the
frozen base weights of the same unit. The float8 conversion leaves the adapted linears and the
adapters in high precision (it converts exact ``nn.Linear`` layers only).

Which linears: :func:`lora_linears` finds them by PEFT's names (``q_proj`` …), which a model
family's Hugging Face names give (``spec.hf.to_hf_name``: ``layers.0.attention.wq`` ↔
``model.layers.0.self_attn.q_proj``); a model without them is matched by its own module names.
:class:`LoRASetup` is a job's choice, resolved once by :func:`torchtitan_lite.job.plan_job`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import torchtitan_lite.models.init as init
from torchtitan_lite.config.schema import lora_settings_problem
from torchtitan_lite.models.nf4 import is_nf4, quantize_base

__all__ = [
    "ADAPTERS",
    "EXPERTS_TARGET",
    "LoRASetup",
    "LoRAWeight",
    "adapter_parameter_names",
    "adapters_disabled",
    "StackedLoRA",
    "apply_lora",
    "expert_stacks",
    "init_lora_weights",
    "is_lora_experts",
    "is_lora_linear",
    "lora_expert_modules",
    "lora_linears",
    "lora_modules",
    "merged_stacked_weight",
    "merged_weight",
    "peft_name",
    "store_frozen_in",
]

ADAPTERS = ("lora_A", "lora_B")
"""The adapter submodules of an adapted linear (PEFT's names)."""

EXPERTS_TARGET = "experts"
"""The ``lora.target_modules`` entry that adapts a mixture of experts' stacked expert weights."""


def _check_settings(rank: Any, alpha: Any, dropout: Any, *, experts: bool = False) -> None:
    """``ValueError`` naming the first setting that is not allowed (the ``[lora]`` keys' rule;
    with ``experts`` adapted, no dropout)."""
    problem = lora_settings_problem(rank, alpha, dropout)
    if problem is not None:
        key, value, allowed = problem
        raise ValueError(f"{key}: invalid value {value!r}; {allowed}")
    if experts and dropout:
        raise ValueError(f"lora.dropout: invalid value {dropout!r}; LoRA on the experts adapts their stacked "
                         "weights, which has no dropout (as PEFT's target_parameters); expected 0")


class LoRAWeight(nn.Module):
    """One adapter matrix, applied as ``x @ weight.T``. Not an ``nn.Linear``, so that conversions
    that swap linears (float8) leave it alone."""

    def __init__(self, out_features: int, in_features: int, *, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"out_features={self.weight.shape[0]}, in_features={self.weight.shape[1]}"


class StackedLoRA(nn.Module):
    """The adapters of one stacked weight ``(experts, out, in)``: ``lora_A`` ``(experts, rank, in)``
    and ``lora_B`` ``(experts, out, rank)``, each expert's update ``B_e A_e`` (PEFT's LoRA on a 3-D
    parameter, ``target_parameters``)."""

    def __init__(self, experts: int, out_features: int, in_features: int, rank: int, *,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(experts, rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(experts, out_features, rank, device=device, dtype=dtype))

    def delta(self, scaling: float) -> torch.Tensor:
        """``scaling · B_e A_e`` for every expert, ``(experts, out, in)``; split over
        expert-parallel ranks (DTensors), this rank's experts."""
        a, b = (w.to_local() if isinstance(w, DTensor) else w for w in (self.lora_A, self.lora_B))
        return torch.bmm(b, a) * scaling


def is_lora_experts(module: nn.Module) -> bool:
    """Whether :func:`apply_lora` adapted ``module``'s stacked expert weights."""
    return bool(getattr(type(module), "_lora_experts", False))


@functools.cache
def _lora_experts_class(cls: type[nn.Module]) -> type[nn.Module]:
    def expert_weights(self: Any) -> tuple[torch.Tensor, ...]:
        base = super(subclass, self).expert_weights()
        if not self.lora_enabled:
            return base
        return tuple(w + getattr(self, f"lora_{name}").delta(self.lora_scaling).to(w.dtype)
                     for name, w in zip(self.stacked_weights, base, strict=True))

    subclass = type(f"LoRA{cls.__name__}", (cls,), {
        "expert_weights": expert_weights, "__module__": cls.__module__, "_lora_experts": True,
        "lora_enabled": True})
    return subclass


def lora_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → module whose stacked expert weights are adapted, in model order."""
    return {name: module for name, module in model.named_modules() if is_lora_experts(module)}


def expert_stacks(model: nn.Module) -> tuple[str, ...]:
    """The modules holding stacked expert weights (those with ``stacked_weights`` and
    ``expert_weights()``: a mixture of experts' experts), in model order."""
    return tuple(name for name, module in model.named_modules()
                 if getattr(module, "stacked_weights", None) and callable(getattr(module, "expert_weights", None)))


def is_lora_linear(module: nn.Module) -> bool:
    """Whether :func:`apply_lora` adapted ``module``."""
    return bool(getattr(type(module), "_lora_linear", False))


@functools.cache
def _lora_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = super(subclass, self).forward(x)  # the layer's own W x + b
        if not self.lora_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling

    def extra_repr(self: Any) -> str:
        return f"{super(subclass, self).extra_repr()}, lora_scaling={self.lora_scaling:g}"

    subclass = type(f"LoRA{cls.__name__}", (cls,), {
        "forward": forward, "extra_repr": extra_repr, "__module__": cls.__module__, "_lora_linear": True,
        "lora_enabled": True})
    return subclass


@functools.cache
def _initialising_class(cls: type[nn.Module]) -> type[nn.Module]:
    def init_weights(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        super(subclass, self).init_weights(*args, **kwargs)
        init_lora_weights(self)

    subclass = type(f"LoRA{cls.__name__}", (cls,), {
        "init_weights": init_weights, "__module__": cls.__module__, "_lora_root": True})
    return subclass


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, every adapted linear and expert stack of ``model`` computes its base weights
    alone (the adapters are skipped, not zeroed): the model is its base, with no second copy of
    the weights, as PEFT's ``disable_adapter()`` makes it (DPO's reference). Outside it, as before."""
    modules = [*lora_modules(model).values(), *lora_expert_modules(model).values()]
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            del module.lora_enabled  # back to the class's True


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name → adapted linear, in model order."""
    return {name: module for name, module in model.named_modules() if is_lora_linear(module)}


def adapter_parameter_names(model: nn.Module) -> list[str]:
    """The names of the adapter parameters (``layers.0.attention.wq.lora_A.weight`` …, and for
    adapted experts ``layers.0.moe.experts.lora_w1.lora_A`` …)."""
    names = [f"{name}.{adapter}.weight" for name in lora_modules(model) for adapter in ADAPTERS]
    return names + [f"{name}.lora_{weight}.{adapter}" for name, module in lora_expert_modules(model).items()
                    for weight in module.stacked_weights for adapter in ADAPTERS]


@torch.no_grad()
def init_lora_weights(model: nn.Module) -> None:
    """Initialise every adapter of ``model`` as PEFT does: A from kaiming-uniform with
    ``a = √5`` (U(±1/√in)), B zeros, so that an adapted model starts as its base. Sharded
    adapters get the same values as unsharded ones (the draws come from the global generator,
    see :mod:`torchtitan_lite.models.init`)."""
    for module in lora_modules(model).values():
        bound = 1.0 / math.sqrt(module.lora_A.weight.shape[1])
        init.uniform_(module.lora_A.weight, a=-bound, b=bound)
        init.zeros_(module.lora_B.weight)
    for module in lora_expert_modules(model).values():
        for weight in module.stacked_weights:
            stack = getattr(module, f"lora_{weight}")
            bound = 1.0 / math.sqrt(stack.lora_A.shape[-1])
            init.uniform_(stack.lora_A, a=-bound, b=bound)
            init.zeros_(stack.lora_B)


def apply_lora(model: nn.Module, *, linears: Sequence[str], rank: int, alpha: float,
               dropout: float = 0.0, experts: Sequence[str] = ()) -> list[str]:
    """Adapt the ``nn.Linear`` layers of ``model`` named in ``linears`` (qualified names, e.g.
    ``layers.0.attention.wq``) and the stacked expert weights of the modules named in
    ``experts`` (:func:`expert_stacks`: each weight ``W`` computes as ``W + (alpha/rank) · B A``
    per expert; no dropout, as PEFT's LoRA on parameters has none) in place, freeze every other
    parameter, and return the names of the adapter parameters.

    The model may be on the meta device (then ``init_weights``, or :func:`init_lora_weights`,
    fills the adapters after ``to_empty``) or on a real one (the adapters are initialised here,
    from the global generator). It must not be sharded or compiled yet. Raises ``ValueError``
    (one line) for a setting that is not allowed, a name that is no linear of the model, or a
    layer that is adapted already.
    """
    _check_settings(rank, alpha, dropout, experts=bool(experts))
    if not linears and not experts:
        raise ValueError("lora: no linears to adapt")
    modules = dict(model.named_modules())
    stacks = set(expert_stacks(model))
    for name in experts:
        if name not in stacks:
            raise ValueError(f"lora: {name!r} is not a module of stacked expert weights")
        if is_lora_experts(modules[name]):
            raise ValueError(f"lora: {name!r} is adapted already")
    for name in linears:
        module = modules.get(name)
        if module is None:
            raise ValueError(f"lora: {name!r} is not a module of the model")
        if not isinstance(module, nn.Linear):
            raise ValueError(f"lora: {name!r} is a {type(module).__name__}, not an nn.Linear")
        if is_lora_linear(module):
            raise ValueError(f"lora: {name!r} is adapted already")
        if isinstance(module.weight, DTensor) or getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(f"lora: {name!r} is sharded or compiled already; apply LoRA first")
    for param in model.parameters():
        param.requires_grad_(False)
    materialised = False
    for name in linears:
        module = modules[name]
        weight = module.weight
        module.__class__ = _lora_class(type(module))
        module.lora_scaling = alpha / rank
        module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        module.lora_A = LoRAWeight(rank, module.in_features, device=weight.device, dtype=weight.dtype)
        module.lora_B = LoRAWeight(module.out_features, rank, device=weight.device, dtype=weight.dtype)
        materialised = materialised or weight.device.type != "meta"
    for name in experts:
        module = modules[name]
        module.__class__ = _lora_experts_class(type(module))
        module.lora_scaling = alpha / rank
        for weight_name in module.stacked_weights:
            weight = getattr(module, weight_name)
            experts_, out_features, in_features = weight.shape
            setattr(module, f"lora_{weight_name}", StackedLoRA(experts_, out_features, in_features, rank,
                                                                device=weight.device, dtype=weight.dtype))
            materialised = materialised or weight.device.type != "meta"
    if callable(getattr(model, "init_weights", None)) and not getattr(type(model), "_lora_root", False):
        model.__class__ = _initialising_class(type(model))
    if materialised:
        init_lora_weights(model)
    return adapter_parameter_names(model)


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Store ``model``'s frozen floating-point parameters (the embedding, norms, output layer of a
    LoRA model; not a 4-bit weight, whose dtype is its compute dtype already) in ``dtype``: they
    never take an optimizer step, so a full-precision copy of them only costs memory. A tied
    parameter stays one. Returns how many were converted."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or not param.is_floating_point() or param.dtype == dtype \
                    or is_nf4(param):
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module._parameters[name] = converted[id(param)]
    return len(converted)


def peft_name(name: str, hf_name: Callable[[str], str] | None = None) -> str:
    """PEFT's name of the linear ``name`` (what ``target_modules`` matches): the last part of
    its weight's Hugging Face name (``layers.0.attention.wq`` → ``q_proj``), or of its own name
    when there is no Hugging Face name for it."""
    if hf_name is not None:
        try:
            return hf_name(f"{name}.weight").removesuffix(".weight").rpartition(".")[2]
        except ValueError:
            pass
    return name.rpartition(".")[2]


def lora_linears(model: nn.Module, target_modules: Sequence[str], *,
                 hf_name: Callable[[str], str] | None = None) -> tuple[str, ...]:
    """The qualified names of ``model``'s ``nn.Linear`` layers whose PEFT name
    (:func:`peft_name`) is one of ``target_modules``, in model order. ``ValueError`` (one line)
    for a target that names no linear of the model."""
    linears = {name: peft_name(name, hf_name) for name, module in model.named_modules()
               if isinstance(module, nn.Linear)}
    known = list(dict.fromkeys(linears.values()))
    missing = [t for t in dict.fromkeys(target_modules) if t not in known]
    if missing:
        raise ValueError(f"{', '.join(map(repr, missing))} {'names' if len(missing) == 1 else 'name'} no linear "
                         f"of the model (its linears: {', '.join(known)})")
    wanted = set(target_modules)
    return tuple(name for name, peft in linears.items() if peft in wanted)


@dataclass(frozen=True)
class LoRASetup:
    """A job's LoRA (``[lora]`` with ``enable = true``), resolved once by
    :func:`~torchtitan_lite.job.plan_job`: the settings and the linears they name."""

    rank: int
    """Rank r of each adapter."""
    alpha: float
    """Scale numerator: the adapters' output is multiplied by alpha / rank."""
    dropout: float
    """Dropout on the adapters' input while training."""
    target_modules: tuple[str, ...]
    """The targets by PEFT's names (written to a PEFT adapter folder)."""
    linears: tuple[str, ...]
    """The adapted linears, our qualified names (``layers.0.attention.wq`` …)."""
    experts: tuple[str, ...] = ()
    """The modules whose stacked expert weights are adapted (target ``experts``)."""
    merge_on_export: bool = False
    """A Hugging Face export holds the merged weights instead of a PEFT adapter folder."""
    quantize_dtype: torch.dtype | None = None
    """QLoRA (``lora.quantize_base = "nf4"``): the base's linears stored as NF4, computed in this
    dtype (:mod:`torchtitan_lite.models.nf4`); None: the base as it is."""

    def __post_init__(self) -> None:
        _check_settings(self.rank, self.alpha, self.dropout, experts=bool(self.experts))

    @classmethod
    def for_model(cls, model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
                  target_modules: Sequence[str], merge_on_export: bool = False,
                  hf_name: Callable[[str], str] | None = None,
                  quantize_dtype: torch.dtype | None = None) -> LoRASetup:
        """The plan for ``model`` (e.g. built on the meta device): ``target_modules`` resolved by
        :func:`lora_linears` (``ValueError``, one line, for a target the model lacks)."""
        linear_targets = [t for t in target_modules if t != EXPERTS_TARGET]
        linears = lora_linears(model, linear_targets, hf_name=hf_name) if linear_targets else ()
        experts = expert_stacks(model) if EXPERTS_TARGET in target_modules else ()
        if EXPERTS_TARGET in target_modules and not experts:
            raise ValueError(f"{EXPERTS_TARGET!r} names no mixture-of-experts layer of the model")
        return cls(rank=rank, alpha=float(alpha), dropout=float(dropout), target_modules=tuple(target_modules),
                   linears=linears, experts=experts, merge_on_export=merge_on_export, quantize_dtype=quantize_dtype)

    @property
    def scaling(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    def apply(self, model: nn.Module) -> list[str]:
        """:func:`apply_lora` with this plan's settings and linears; with :attr:`quantize_dtype`, then
        the base's linears as NF4 (:func:`~torchtitan_lite.models.nf4.quantize_base`)."""
        names = apply_lora(model, linears=self.linears, rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                           experts=self.experts)
        if self.quantize_dtype is not None:
            quantize_base(model, dtype=self.quantize_dtype)
            store_frozen_in(model, self.quantize_dtype)
        return names

    def describe(self, model: nn.Module) -> str:
        """One log line: what is adapted and how many parameters train."""
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g} (scale {self.scaling:g}), dropout {self.dropout:g} on "
                f"{len(self.linears)} linears"
                f"{f' and the experts of {len(self.experts)} layers' if self.experts else ''} "
                f"({', '.join(self.target_modules)}): {trainable / 1e6:.3f}M trainable "
                f"{'' if self.quantize_dtype is None else 'on a base of 4-bit NF4 linears, '}"
                f"parameters of {total / 1e6:.2f}M ({100 * trainable / max(total, 1):.2f}%), the rest frozen; "
                f"Hugging Face export: {'merged weights' if self.merge_on_export else 'PEFT adapter folder'}")


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling · B A`` (per expert for stacked weights) laid out as ``W``: under FSDP a
    DTensor sharded as ``W`` is, each rank computing only its own part (``B`` is sharded as ``W``;
    ``A`` is gathered, and for stacked weights cut to the experts this rank's ``W`` holds)."""
    if not isinstance(w, DTensor):
        return w.detach() + (torch.matmul(b.detach(), a.detach()) * scaling).to(w.dtype)
    if not isinstance(b, DTensor):
        raise ValueError("lora: lora_B is not sharded as the base weight")
    if (b.placements != w.placements or b.device_mesh != w.device_mesh) and a.dim() == 2:
        # Split otherwise (tensor parallel's row-wise linears: B replicated where W is split by
        # columns): DTensor computes B A and lays it out as W.
        delta = torch.matmul(b.detach(), a.detach()).redistribute(w.device_mesh, w.placements)
        return w.detach() + (delta * scaling).to(w.dtype)
    if b.placements != w.placements or b.device_mesh != w.device_mesh:
        raise ValueError("lora: lora_B is not sharded as the base weight")
    a_full = a.full_tensor() if isinstance(a, DTensor) else a.detach()
    if a_full.dim() == 3:  # stacked: this rank's experts (all of them when W is sharded on rows)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        a_full = a_full[offset[0]:offset[0] + shape[0]]
    local = w.to_local() + (torch.matmul(b.to_local(), a_full.to(b.dtype)) * scaling).to(w.dtype)
    return DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


@torch.no_grad()
def merged_stacked_weight(module: nn.Module, weight: str) -> torch.Tensor:
    """``W + (alpha/rank) · B_e A_e`` of an adapted stacked expert weight, laid out (and under
    FSDP sharded) as ``W`` (:func:`_merged`)."""
    if not is_lora_experts(module):
        raise ValueError(f"merged_stacked_weight: {type(module).__name__} has no adapted experts")
    stack = getattr(module, f"lora_{weight}")
    return _merged(getattr(module, weight), stack.lora_A, stack.lora_B, module.lora_scaling)


@torch.no_grad()
def merged_weight(module: nn.Module) -> torch.Tensor:
    """``W + (alpha/rank) · B A`` of an adapted linear, laid out as ``W``: under FSDP a DTensor
    sharded as ``W`` is, each rank computing only its own rows (:func:`_merged`)."""
    if not is_lora_linear(module):
        raise ValueError(f"merged_weight: {type(module).__name__} is not an adapted linear")
    return _merged(module.weight, module.lora_A.weight, module.lora_B.weight, module.lora_scaling)
