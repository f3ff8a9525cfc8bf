"""Apply FSDP2 (``fully_shard``) to a model: units, reshard policy, mixed precision, CPU offload.

Works on our Llama model and on any ``nn.Module`` whose blocks the caller names::

    from torchtitan_lite.parallelize import apply_fsdp
    apply_fsdp(model, mesh, blocks=model.blocks, reshard_after_forward_mode="default")

Units are wrapped bottom-up in forward order: an optional first unit (e.g. the token
embedding), each block, an optional last unit (e.g. final norm + output projection, which may
be several modules sharded as one group), then the root.

The reshard mode is ``default``, ``always``, ``never``, an integer group size, or a per-unit
plan: one bool per unit in forward order (what ``reshard_after_forward_mode = "auto"`` becomes,
see :func:`torchtitan_lite.estimate.plan_auto_reshard`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

__all__ = [
    "RESHARD_MODES",
    "FSDPUnit",
    "ReshardMode",
    "UnitRole",
    "apply_fsdp",
    "build_sharded_model",
    "fsdp_units",
    "resolve_reshard_after_forward",
    "validate_reshard_after_forward_mode",
]

RESHARD_MODES = ("default", "always", "never")
UnitRole = Literal["first", "block", "last"]
ReshardMode = str | int | tuple[bool, ...]
"""A named mode, an integer group size, or a per-unit plan (one bool per unit, forward order)."""

ModuleOrGroup = nn.Module | Sequence[nn.Module]


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call of :func:`apply_fsdp`."""

    name: str
    """Qualified module name(s), ``+``-joined for a group: ``tok_embeddings``, ``layers.0``,
    ``norm+output``."""
    modules: tuple[nn.Module, ...]
    """The module, or the modules sharded as one group."""
    role: UnitRole
    """Where it runs: before the blocks, a block, after the blocks."""

    def numel(self) -> int:
        """Parameters of the unit (full, unsharded size)."""
        return sum(p.numel() for m in self.modules for p in m.parameters())


def validate_reshard_after_forward_mode(
    mode: str | int | Sequence[bool], shard_degree: int | None
) -> ReshardMode:
    """Return the mode normalised (``"2"`` → ``2``, a list of bools → a tuple) or raise
    ``ValueError`` naming what is allowed.

    An integer mode reshards to groups of that many ranks after forward (e.g. the GPUs of one
    node); it must be a proper divisor of the shard degree: greater than 1, smaller than the
    shard degree and dividing it. With ``shard_degree=None`` (not known yet) only the form of
    the mode is checked. A per-unit plan's length is checked by :func:`apply_fsdp`, which knows
    the units.
    """
    if isinstance(mode, str) and mode in RESHARD_MODES:
        return mode
    if isinstance(mode, (list, tuple)):
        if not mode or not all(isinstance(flag, bool) for flag in mode):
            raise ValueError(
                f"reshard_after_forward_mode={mode!r} is not allowed; a per-unit plan is a "
                "non-empty sequence of bools, one per FSDP unit in forward order"
            )
        return tuple(mode)
    if isinstance(mode, str) and mode.strip().lstrip("-").isdigit():
        mode = int(mode)
    if not isinstance(mode, int) or isinstance(mode, bool):
        hint = (" ('auto' is resolved into a per-unit plan by the trainer or by "
                "torchtitan_lite.estimate.plan_auto_reshard)" if mode == "auto" else "")
        raise ValueError(
            f"reshard_after_forward_mode={mode!r} is not allowed; use one of "
            f"{', '.join(RESHARD_MODES)}, an integer group size or one bool per unit{hint}"
        )
    if shard_degree is None:
        return mode
    divisors = [d for d in range(2, shard_degree) if shard_degree % d == 0]
    if mode not in divisors:
        allowed = ", ".join(map(str, divisors)) if divisors else "none at this shard degree"
        raise ValueError(
            f"reshard_after_forward_mode={mode} must be a proper divisor of the data-parallel "
            f"shard degree {shard_degree} (allowed integers: {allowed})"
        )
    return mode


def resolve_reshard_after_forward(mode: ReshardMode, role: UnitRole, index: int) -> bool | int:
    """The one place where a reshard mode becomes a unit's ``reshard_after_forward``.

    ``index`` is the unit's position in forward order (0: the first unit), used by a per-unit
    plan: a tuple of bools whose ``index``-th entry is the unit's setting.

    - ``always``: every unit reshards after forward.
    - ``never``: no unit does (parameters stay unsharded from forward to backward).
    - ``default``: every unit reshards except the one that runs last in forward (final norm +
      output): backward needs it again at once, so freeing it would only buy an all-gather.
    - an integer ``N``: like ``default``, but the resharding units keep 1/N of the parameters
      (reshard within groups of N ranks, e.g. one node) instead of freeing down to the shard.
    """
    if isinstance(mode, tuple):
        return mode[index]
    if mode == "always":
        return True
    if mode == "never":
        return False
    if role == "last":
        return False
    if mode == "default":
        return True
    if isinstance(mode, int) and not isinstance(mode, bool):
        return mode
    raise ValueError(f"unknown reshard_after_forward_mode {mode!r}")


@contextlib.contextmanager
def _shared_post_forward_mesh() -> Iterator[None]:
    """Let every unit with an integer reshard size share one post-forward mesh.

    ``fully_shard`` builds a new ``DeviceMesh`` (two new process groups) for each unit given an
    integer ``reshard_after_forward``; on GPUs each is an NCCL communicator with its own memory,
    i.e. dozens for a 32-layer model. The groups are the same for every unit, so the mesh info
    is built once per (size, mesh) and reused. Falls back to FSDP's behaviour if its internals
    change.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as fsdp_module

        original = fsdp_module._get_post_forward_mesh_info
    except (ImportError, AttributeError):  # pragma: no cover - other torch versions
        yield
        return
    cache: dict[tuple[Any, ...], Any] = {}

    def cached(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool):
            return original(reshard_after_forward, mesh_info)
        key = (reshard_after_forward, id(mesh_info.mesh), mesh_info.shard_mesh_dim)
        if key not in cache:
            cache[key] = original(reshard_after_forward, mesh_info)
        return cache[key]

    fsdp_module._get_post_forward_mesh_info = cached
    try:
        yield
    finally:
        fsdp_module._get_post_forward_mesh_info = original


def _as_list(unit: ModuleOrGroup) -> list[nn.Module]:
    return [unit] if isinstance(unit, nn.Module) else list(unit)


def _find_blocks(
    model: nn.Module, blocks: Sequence[nn.Module] | Callable[[str, nn.Module], bool] | None
) -> list[nn.Module]:
    if blocks is None:
        layers = getattr(model, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            return list(layers.values())
        if isinstance(layers, (nn.ModuleList, nn.Sequential)):
            return list(layers)
        raise ValueError(
            "apply_fsdp could not find the model's blocks: pass blocks= as a list of modules "
            "or a predicate (name, module) -> bool"
        )
    if callable(blocks) and not isinstance(blocks, nn.Module):
        predicate = blocks
        found = [m for name, m in model.named_modules() if name and predicate(name, m)]
        if not found:
            raise ValueError("apply_fsdp: the blocks predicate matched no submodule")
        return found
    return list(blocks)  # type: ignore[arg-type]


def fsdp_units(
    model: nn.Module,
    *,
    blocks: Sequence[nn.Module] | Callable[[str, nn.Module], bool] | None = None,
    first_unit: ModuleOrGroup | None | Literal["auto"] = "auto",
    last_unit: ModuleOrGroup | None | Literal["auto"] = "auto",
) -> list[FSDPUnit]:
    """The units :func:`apply_fsdp` shards (same arguments), in forward order, root excluded."""
    if first_unit == "auto":
        emb = getattr(model, "tok_embeddings", None)
        first_unit = emb if isinstance(emb, nn.Module) else None
    if last_unit == "auto":
        norm, output = getattr(model, "norm", None), getattr(model, "output", None)
        last_unit = (
            [norm, output]
            if isinstance(norm, nn.Module) and isinstance(output, nn.Module)
            else None
        )
    names = {id(m): name for name, m in model.named_modules()}

    def unit(modules: ModuleOrGroup, role: UnitRole) -> FSDPUnit:
        group = tuple(_as_list(modules))
        return FSDPUnit("+".join(names.get(id(m), type(m).__name__) for m in group), group, role)

    units = [] if first_unit is None else [unit(first_unit, "first")]
    units += [unit(block, "block") for block in _find_blocks(model, blocks)]
    if last_unit is not None:
        units.append(unit(last_unit, "last"))
    return units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward_mode: str | int | Sequence[bool] = "default",
    param_dtype: torch.dtype | None = torch.float32,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    blocks: Sequence[nn.Module] | Callable[[str, nn.Module], bool] | None = None,
    first_unit: ModuleOrGroup | None | Literal["auto"] = "auto",
    last_unit: ModuleOrGroup | None | Literal["auto"] = "auto",
) -> FSDPModule:
    """Shard ``model`` with FSDP2 in place and return it (now also an ``FSDPModule``).

    Args:
        model: the module to shard; may live on the meta device (materialise afterwards with
            ``to_empty`` and initialise the parameters).
        mesh: 1-D mesh (FSDP) or 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP).
        reshard_after_forward_mode: ``default``, ``always``, ``never``, an integer group size,
            or one bool per unit in forward order (see :func:`resolve_reshard_after_forward`
            and :func:`fsdp_units`).
        param_dtype: dtype of all-gathered parameters and of compute (sharded parameters and
            optimizer state keep the model's dtype, normally fp32).
        reduce_dtype: dtype in which gradients are reduced.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU (pinned only
            when CUDA is available). The process group then needs a CPU backend for clipping.
        blocks: the repeated blocks, as modules or a predicate ``(qualified_name, module) ->
            bool``; default ``model.layers``.
        first_unit: module(s) that run before the blocks, sharded as one unit; ``"auto"`` means
            ``model.tok_embeddings`` when present, ``None`` means none.
        last_unit: module(s) that run after the blocks, sharded as one unit; ``"auto"`` means
            ``[model.norm, model.output]`` when present, ``None`` means none.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp expects a 1-D or 2-D device mesh, got {mesh.ndim}-D")
    mode = validate_reshard_after_forward_mode(reshard_after_forward_mode, mesh.shape[-1])
    units = fsdp_units(model, blocks=blocks, first_unit=first_unit, last_unit=last_unit)
    if isinstance(mode, tuple) and len(mode) != len(units):
        raise ValueError(
            f"reshard_after_forward_mode: a per-unit plan of {len(mode)} bools, but the model "
            f"has {len(units)} FSDP units ({', '.join(u.name for u in units)})"
        )

    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    common = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": offload,
    }

    with _shared_post_forward_mesh() if isinstance(mode, int) else contextlib.nullcontext():
        for index, unit in enumerate(units):
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            fully_shard(
                target,  # type: ignore[arg-type]
                reshard_after_forward=resolve_reshard_after_forward(mode, unit.role, index),
                **common,  # type: ignore[arg-type]
            )
    # The root keeps FSDP's own rule: it is not resharded after forward (backward needs it
    # at once). With every submodule in a unit it usually owns no parameters at all.
    fully_shard(model, **common)  # type: ignore[arg-type]
    return model  # type: ignore[return-value]


def build_sharded_model(
    model_cls: Callable[[Any], nn.Module],
    args: Any,
    mesh: DeviceMesh,
    *,
    device: torch.device,
    seed: int,
    **fsdp_options: Any,
) -> nn.Module:
    """The meta-init path: build ``model_cls(args)`` on the meta device, shard it with
    :func:`apply_fsdp` (``fsdp_options`` are its keyword arguments), allocate this rank's shards
    (on CPU under ``cpu_offload``, else on ``device``) and fill them with ``init_weights`` from
    ``seed``. No rank ever holds the full model."""
    with torch.device("meta"):
        model = model_cls(args)
    apply_fsdp(model, mesh, **fsdp_options)
    model.to_empty(device=torch.device("cpu") if fsdp_options.get("cpu_offload") else device)
    torch.manual_seed(seed)  # the weights depend on the seed only, not on the world size
    model.init_weights(buffer_device=device)  # type: ignore[operator]
    return model
