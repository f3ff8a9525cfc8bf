"""Apply FSDP2 (``fully_shard``) to a model: units, reshard policy, mixed precision, CPU offload.

Works on our models (their :class:`~torchtitan_lite.models.spec.ModelSpec` names the units) and on
any ``nn.Module`` whose units the caller names::

    from torchtitan_lite.distributed.fsdp import apply_fsdp
    apply_fsdp(model, mesh, blocks=model.blocks, first_unit=model.embed, last_unit=[model.norm, model.head],
               param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

Units are wrapped bottom-up in forward order: an optional first unit (e.g. the token
embedding), each block, an optional last unit (e.g. final norm + output projection, which may
be several modules sharded as one group), then the root, which takes every parameter no unit
holds. Units are checked before anything is sharded: no module in two units or inside another
unit, and no parameter shared between units (tied weights belong in one unit).

The reshard mode is ``default``, ``always``, ``never``, an integer group size, or a per-unit
plan: one bool per unit in forward order (what ``reshard_after_forward_mode = "auto"`` becomes,
see :mod:`torchtitan_lite.memory.auto`).
"""

from __future__ import annotations

import contextlib
import functools
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
from torch.distributed.tensor import DTensor, Shard

from torchtitan_lite.config.schema import RESHARD_MODES
from torchtitan_lite.models.nf4 import allocate_constants, nf4_weights

try:  # the interfaces of fully_shard's custom reduce-scatter and all-gather (torch >= 2.7)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as AllGatherComm
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterComm
except ImportError:  # pragma: no cover - older torch: gloo's own collectives are used
    _ReduceScatterComm = object
    AllGatherComm = object  # type: ignore[assignment,misc]

__all__ = [
    "RESHARD_MODES",
    "AllGatherComm",
    "FSDPOptions",
    "FSDPUnit",
    "InPlaceReduceScatter",
    "ReshardMode",
    "UnitRole",
    "ExpertShards",
    "apply_fsdp",
    "find_blocks",
    "fsdp_units",
    "gathered_through_step",
    "set_custom_all_gather",
    "materialize",
    "reshard_all",
    "resolve_reshard_after_forward",
    "stacked_shard_placement",
    "sum_then_divide",
    "unit_offload",
    "validate_reshard_after_forward_mode",
]

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
        """Parameters of the unit (full, unsharded size); a tied weight counts once."""
        params = {id(p): p for m in self.modules for p in m.parameters()}
        return sum(p.numel() for p in params.values())


@dataclass(frozen=True)
class FSDPOptions:
    """How :func:`apply_fsdp` shards a job's model (its keywords other than the units), as the
    job plan resolves them once (:class:`~torchtitan_lite.job.JobPlan`)."""

    reshard_after_forward_mode: ReshardMode = "default"
    """``default``, ``always``, ``never``, an integer group size, or one bool per unit."""
    param_dtype: torch.dtype | None = None
    """Dtype of all-gathered parameters and of compute (None: the model's own)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction (None: the compute dtype)."""
    cpu_offload: bool | tuple[bool, ...] = False
    """Keep shards, gradients and optimizer state on CPU: every unit, or one bool per unit in
    forward order."""


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
                "torchtitan_lite.memory.auto.plan_auto_reshard)" if mode == "auto" else "")
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


Blocks = nn.Module | Sequence[nn.Module] | Callable[[str, nn.Module], bool]
"""Blocks as a container (``ModuleList``, ``Sequential``, ``ModuleDict``), a list of modules, one
module, or a predicate ``(qualified_name, module) -> bool``."""


def _modules_of(unit: ModuleOrGroup, what: str) -> list[nn.Module]:
    """A unit's modules: one module, a list of them, or a container's children."""
    if isinstance(unit, nn.ModuleDict):
        return list(unit.values())
    if isinstance(unit, (nn.ModuleList, nn.Sequential)) or not isinstance(unit, nn.Module):
        try:
            modules = list(unit)
        except TypeError:
            raise TypeError(f"apply_fsdp: {what} must be a module or a list of modules, got "
                            f"{type(unit).__name__}") from None
        bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"apply_fsdp: {what} must hold modules, got {bad[0]}")
        return modules
    return [unit]


def find_blocks(model: nn.Module, blocks: Blocks) -> list[nn.Module]:
    """The blocks ``blocks`` names in ``model`` (see :data:`Blocks`), in order."""
    if callable(blocks) and not isinstance(blocks, nn.Module):
        predicate = blocks
        found = [m for name, m in model.named_modules() if name and predicate(name, m)]
        if not found:
            raise ValueError("apply_fsdp: the blocks predicate matched no submodule")
        return found
    if isinstance(blocks, (nn.ModuleDict, nn.ModuleList, nn.Sequential)) or not isinstance(blocks, nn.Module):
        return _modules_of(blocks, "blocks")
    return [blocks]  # one module: one block


def fsdp_units(
    model: nn.Module,
    *,
    blocks: Blocks,
    first_unit: ModuleOrGroup | None = None,
    last_unit: ModuleOrGroup | None = None,
) -> list[FSDPUnit]:
    """The units :func:`apply_fsdp` shards (same arguments), in forward order, root excluded.

    Raises ``ValueError`` with one line naming the units when a module is in two units, one
    unit's module is inside another's (e.g. a predicate that matches a block and a module in
    it), a unit is not part of ``model``, or a parameter is shared between units (tied weights:
    put the modules that share it in one unit).
    """
    names = {id(m): name for name, m in model.named_modules()}

    def unit(modules: list[nn.Module], role: UnitRole) -> FSDPUnit:
        for m in modules:
            if id(m) not in names:
                raise ValueError(f"apply_fsdp: a {role} unit's {type(m).__name__} is not a submodule of the model")
            if m is model:
                raise ValueError("apply_fsdp: the model itself cannot be a unit (it is the root)")
        return FSDPUnit("+".join(names[id(m)] for m in modules), tuple(modules), role)

    units = [] if first_unit is None else [unit(_modules_of(first_unit, "first_unit"), "first")]
    units += [unit([block], "block") for block in find_blocks(model, blocks)]
    if last_unit is not None:
        units.append(unit(_modules_of(last_unit, "last_unit"), "last"))
    _check_units(model, units, names)
    return units


def _check_units(model: nn.Module, units: list[FSDPUnit], names: dict[int, str]) -> None:
    """No module in two units or inside another unit; no parameter shared between units."""
    argument = {"first": "first_unit", "block": "blocks", "last": "last_unit"}  # where a unit of a role came from
    owner: dict[int, str] = {}  # module id -> unit name
    described: dict[int, str] = {}  # module id -> the unit, named by its argument and its name
    for u in units:
        for m in u.modules:
            here = f"{argument[u.role]} {u.name!r}"
            if id(m) in owner:
                raise ValueError(f"apply_fsdp: module {names[id(m)]!r} is in two units ({described[id(m)]} and "
                                 f"{here}); each module can be sharded once")
            owner[id(m)] = u.name
            described[id(m)] = here
    for u in units:
        for m in u.modules:
            for sub_name, sub in m.named_modules():
                if sub_name and id(sub) in owner:
                    raise ValueError(
                        f"apply_fsdp: unit {owner[id(sub)]!r} is inside unit {u.name!r}; units must not "
                        "nest (a blocks predicate matched a block and a module within it? match only "
                        "the blocks)")
    # Tied weights: one tensor reachable under two names must not be split between units (or
    # between a unit and the root), or FSDP2 shards it once and the other user sees a shard.
    prefixes = [(names[id(m)] + ".", u.name) for u in units for m in u.modules]

    def unit_of(param_name: str) -> str:
        return next((unit for prefix, unit in prefixes if param_name.startswith(prefix)), "the root")

    first_seen: dict[int, tuple[str, str]] = {}  # parameter id -> (unit, name)
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = unit_of(name)
        seen = first_seen.setdefault(id(param), (unit, name))
        if seen[0] != unit:
            owner_a, owner_b = seen[1].rpartition(".")[0], name.rpartition(".")[0]
            raise ValueError(
                f"apply_fsdp: parameter {seen[1]!r} (unit {seen[0]!r}) and {name!r} (unit {unit!r}) are the "
                f"same tensor (tied weights); shard them in one unit, e.g. first_unit=[model.{owner_a}, "
                f"model.{owner_b}] (and leave {owner_b!r} out of the other units), or untie them")


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP unit's unsharded parameters (after forward passes without a backward, e.g.
    validation: ``never``/``default`` keep some units gathered until a backward would reshard
    them). Does nothing on a model without FSDP."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class InPlaceReduceScatter(_ReduceScatterComm):
    """FSDP2's gradient reduce-scatter as an all-reduce of FSDP's own input buffer, in place,
    then a copy of this rank's slice: the same sums and bytes on the wire as gloo's
    reduce-scatter, without its copy. Gloo reduce-scatters by all-reducing a clone of the whole
    input (a unit's unsharded gradients), which its worker thread frees some time after the call
    has returned: at local batch 1 × seq 16 (debugmodel, 2 ranks) one unit's clone was still
    alive at the step's peak in some runs and not in others (+3.2 MiB, 6% of that peak), so no
    estimate could hold both ways. FSDP2 keeps its input buffer until the next reduce-scatter
    anyway, so writing the sum into it costs no memory. :func:`apply_fsdp` uses it on CPU meshes
    (gloo); CUDA meshes keep NCCL's reduce-scatter."""

    running = False
    """True while the all-reduce of a reduce-scatter runs: what tells a collective recorder (a
    dispatch mode, which sees ``c10d::allreduce_``) that it is a reduce-scatter."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The output shard: a plain tensor, as FSDP2's default."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        """Reduce ``input_tensor`` over ``group`` with ``op`` in place (synchronously, whatever
        ``async_op``: FSDP2 on CPU has no stream to overlap with) and copy this rank's slice
        into ``output_tensor``."""
        import torch.distributed as dist

        InPlaceReduceScatter.running = True
        try:
            dist.all_reduce(input_tensor, op=op, group=group)
        finally:
            InPlaceReduceScatter.running = False
        size = dist.get_world_size(group)
        output_tensor.copy_(input_tensor.view(size, -1)[dist.get_rank(group)])


def unit_offload(cpu_offload: bool | Sequence[bool], units: Sequence[FSDPUnit]) -> tuple[bool, ...]:
    """Whether each unit is offloaded to CPU: ``cpu_offload`` for every unit, or its one bool
    per unit (``ValueError`` when the count is not the units')."""
    if isinstance(cpu_offload, bool):
        return (cpu_offload,) * len(units)
    flags = tuple(cpu_offload)
    if len(flags) != len(units) or not all(isinstance(flag, bool) for flag in flags):
        raise ValueError(f"cpu_offload: a per-unit plan is {len(units)} bools, one per FSDP unit "
                         f"({', '.join(u.name for u in units)}); got {cpu_offload!r}")
    return flags


def materialize(model: nn.Module, device: torch.device, *, units: Sequence[FSDPUnit] = (),
                cpu_offload: bool | Sequence[bool] = False) -> None:
    """Allocate a model sharded on the meta device (``to_empty``): the shards of offloaded units
    (``cpu_offload``, as given to :func:`apply_fsdp` with these ``units``) on CPU, everything else
    on ``device``. Parameters shared between modules (tied embedding and output) stay shared:
    on a plain module ``to_empty`` would give each name a parameter of its own."""
    flags = unit_offload(cpu_offload, units) if units else (bool(cpu_offload),)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    cpu = torch.device("cpu")
    if units and any(flags) and not all(flags):
        for unit, offload in zip(units, flags, strict=True):
            for module in unit.modules:
                module.to_empty(device=cpu if offload else device)
        model._apply(lambda t: torch.empty_like(t, device=device) if t.device.type == "meta" else t)
    else:
        model.to_empty(device=cpu if all(flags) else device)
    for aliases in names.values():
        shared = model.get_parameter(aliases[0])
        for alias in aliases[1:]:
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    for name, weight in nf4_weights(model):  # (QLoRA's 4-bit weights: FSDP on one rank leaves them plain)
        if not isinstance(weight, DTensor) and weight.device != device:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(weight.to(device), requires_grad=False))
    allocate_constants(model)


def stacked_shard_placement(param: nn.Parameter, *, shard_degree: int) -> Shard | None:
    """Where FSDP shards a parameter: a stacked weight (3-D, e.g. a mixture of experts'
    ``(experts, out, in)``) along its first dimension, the experts, while there are at least as
    many of them as shard ranks, else along the next when the ranks divide it (every rank holds
    part of every expert rather than some ranks nothing; FSDP2 shards a later dimension only
    evenly); anything else along dim 0 (None: FSDP's default)."""
    if param.dim() == 3 and param.shape[0] < shard_degree and param.shape[1] % shard_degree == 0:
        return Shard(1)  # (FSDP2 shards a later dimension only evenly)
    return None


@dataclass(frozen=True)
class ExpertShards:
    """Modules inside the units that FSDP shards over a mesh of their own, before their unit: a
    mixture of experts' experts, already split over the expert-parallel ranks
    (:func:`~torchtitan_lite.distributed.expert_parallel.shard_experts`), sharded over the
    expert-data ranks. Each takes the mixed precision of every unit and the reshard and offload
    setting of the unit it is in (an integer reshard size of the model's mesh: resharded on its
    own mesh)."""

    modules: Sequence[nn.Module]
    mesh: DeviceMesh
    """The expert-data ranks (the job mesh's ``experts``)."""
    gradient_divide_factor: float
    """Their gradients are summed over ``mesh``, then divided by this (every data-parallel rank:
    each expert's gradient already sums the tokens of its expert-parallel group)."""


def sum_then_divide(module: FSDPModule, factor: float) -> None:
    """Make the FSDP module ``module`` sum its gradients over its ranks, then divide them by
    ``factor`` once.

    The division runs in FSDP's post-reduce hook, not through its gradient divide factor: on a
    mesh of one rank (expert parallel equal to the data-parallel shard degree), torch 2.11 and
    later divide a custom factor both in their copy that stands in for the reduce-scatter and
    again after it when sums are forced, so experts trained on gradients ``factor`` times too
    small (torch 2.9 divides once). A factor of 1 and the hook give one division on every mesh
    size and version. Sums, not FSDP's pre-multiplied sums: gloo has none."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)

    def divide(reduced: torch.Tensor) -> None:
        reduced.div_(factor)

    module.set_all_reduce_hook(divide)


def offload_policy(mesh: DeviceMesh, offload: bool) -> OffloadPolicy:
    """FSDP2's offload policy of a unit on ``mesh``: CPU offload when ``offload``. Pinned host
    memory speeds the copies to and from a GPU; a mesh on CPU (the memory estimator's fake world,
    whose fake tensors cannot be pinned) copies nothing."""
    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: torch >= 2.12 keeps a list (``_fsdp_param_groups``), torch
    2.11 at most one (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Blocks,
    first_unit: ModuleOrGroup | None = None,
    last_unit: ModuleOrGroup | None = None,
    reshard_after_forward_mode: str | int | Sequence[bool] = "default",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool | Sequence[bool] = False,
    experts: ExpertShards | None = None,
    **fully_shard_kwargs: Any,
) -> FSDPModule:
    """Shard ``model`` with FSDP2 in place and return it (now also an ``FSDPModule``).

    Args:
        model: the module to shard; may live on the meta device (materialise afterwards with
            ``to_empty`` and initialise the parameters with :mod:`torchtitan_lite.models.init`,
            whose values do not depend on the sharding).
        mesh: 1-D mesh (FSDP) or 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP).
        blocks: the repeated blocks: a ``ModuleList``/``Sequential``/``ModuleDict``, a list of
            modules, one module, or a predicate ``(qualified_name, module) -> bool``. Each block
            is one unit.
        first_unit: module(s) that run before the blocks, sharded as one unit (None: none).
        last_unit: module(s) that run after the blocks, sharded as one unit (None: none).
        reshard_after_forward_mode: ``default``, ``always``, ``never``, an integer group size,
            or one bool per unit in forward order (see :func:`resolve_reshard_after_forward`
            and :func:`fsdp_units`).
        param_dtype: dtype of all-gathered parameters and of compute; None keeps the model's
            own dtype (a bf16 model computes in bf16). Sharded parameters and optimizer state
            keep the model's dtype.
        reduce_dtype: dtype in which gradients are reduced; None: the compute dtype.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU (pinned only
            when CUDA is available), for every unit or per unit (one bool per unit in forward
            order; the root's own parameters, if any, are offloaded only when every unit is).
            The process group then needs a CPU backend for clipping. Materialise with
            :func:`materialize` so that each unit's shards land where they live.
        experts: modules inside the units sharded first over a mesh of their own (a mixture
            of experts' experts split over expert-parallel ranks, see :class:`ExpertShards`).
        fully_shard_kwargs: any other ``fully_shard`` option, given to every unit and the
            root (``shard_placement_fn`` replaces :func:`stacked_shard_placement`).

    Raises ``ValueError`` (one line) for units that overlap or share parameters (see
    :func:`fsdp_units`), a reshard mode that is not allowed, or a per-unit plan of the wrong
    length, before anything is sharded.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp expects a 1-D or 2-D device mesh, got {mesh.ndim}-D")
    taken = {"mesh", "reshard_after_forward", "mp_policy", "offload_policy"} & set(fully_shard_kwargs)
    if taken:
        raise ValueError(f"apply_fsdp: {', '.join(sorted(taken))} is set by apply_fsdp itself (use mesh, "
                         "reshard_after_forward_mode, param_dtype/reduce_dtype, cpu_offload)")
    mode = validate_reshard_after_forward_mode(reshard_after_forward_mode, mesh.shape[-1])
    units = fsdp_units(model, blocks=blocks, first_unit=first_unit, last_unit=last_unit)
    if isinstance(mode, tuple) and len(mode) != len(units):
        raise ValueError(
            f"reshard_after_forward_mode: a per-unit plan of {len(mode)} bools, but the model "
            f"has {len(units)} FSDP units ({', '.join(u.name for u in units)})"
        )

    offloaded = unit_offload(cpu_offload, units)

    common = {
        "mesh": mesh,
        "shard_placement_fn": functools.partial(stacked_shard_placement, shard_degree=mesh.shape[-1]),
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        **fully_shard_kwargs,
    }
    if mesh.size() == 1 and "ignored_params" not in common:
        # FSDP2 on one rank copies a parameter's single all-gather input in place of the
        # all-gather, which a 4-bit weight's three inputs (codes, scales, factors) defeat: on one
        # rank there is nothing to shard, and QLoRA's weights stay plain (on the compute device).
        quantized = {param for _, param in nf4_weights(model)}
        if quantized:
            common["ignored_params"] = quantized

    if experts is not None:
        _shard_experts(experts, units, mode, offloaded, common["mp_policy"])
    in_place = mesh.device_type == "cpu" and _ReduceScatterComm is not object
    with _shared_post_forward_mesh() if isinstance(mode, int) else contextlib.nullcontext():
        for index, unit in enumerate(units):
            target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
            sharded = fully_shard(
                target,
                reshard_after_forward=resolve_reshard_after_forward(mode, unit.role, index),
                offload_policy=offload_policy(mesh, offloaded[index]),
                **common,
            )
            if in_place:  # a group of modules shares one FSDP state: set it through the first
                first = sharded[0] if isinstance(sharded, list) else sharded
                first.set_custom_reduce_scatter(InPlaceReduceScatter())
    # The root keeps FSDP's own rule: it is not resharded after forward (backward needs it
    # at once). With every submodule in a unit it usually owns no parameters at all.
    root = fully_shard(model, offload_policy=offload_policy(mesh, all(offloaded)), **common)
    if in_place and _param_groups(root._get_fsdp_state()):
        root.set_custom_reduce_scatter(InPlaceReduceScatter())
    return model


def _shard_experts(experts: ExpertShards, units: Sequence[FSDPUnit], mode: ReshardMode, offloaded: Sequence[bool],
                   mp_policy: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each of ``experts.modules`` on its mesh with the settings of its unit."""
    for module in experts.modules:
        index = next((i for i, unit in enumerate(units) if any(module in m.modules() for m in unit.modules)), None)
        if index is None:
            raise ValueError("apply_fsdp: an experts module is in none of the model's FSDP units; the units must "
                             "hold every block")
        reshard = resolve_reshard_after_forward(mode, units[index].role, index)
        sharded = fully_shard(module, mesh=experts.mesh, reshard_after_forward=bool(reshard), mp_policy=mp_policy,
                              offload_policy=offload_policy(experts.mesh, offloaded[index]))
        sum_then_divide(sharded, experts.gradient_divide_factor)


# --------------------------------------------------------------------------------------------
# FSDP2's internals: used here only (when torch changes them, this file is the one to mend)
# --------------------------------------------------------------------------------------------


def set_custom_all_gather(model: nn.Module, comm: Any) -> None:
    """Every FSDP unit of ``model`` that holds parameters all-gathers through ``comm`` (an
    :data:`AllGatherComm`)."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and _param_groups(module._get_fsdp_state()):
            module.set_custom_all_gather(comm)


def _backward_defaults(model: FSDPModule, on: bool) -> None:
    """FSDP's end-of-backward settings: the last backward, reshard after it, reduce gradients
    (``on``), or none of them until told (holding everything gathered)."""
    model.set_is_last_backward(on)
    model.set_reshard_after_backward(on)
    model.set_requires_gradient_sync(on)


@contextlib.contextmanager
def gathered_through_step(model: nn.Module) -> Iterator[None]:
    """Every unit of an FSDP ``model`` stays gathered from its forward through its backward
    passes and accumulates unsharded gradients, reducing none, for the duration (a split-backward
    pipeline schedule, whose weight passes come after the input passes of later micro-batches);
    then, once for the step, what FSDP's backward would have done at its end: each unit's
    gradient reduced (the last unit's first) and its parameters resharded. When the step raises,
    every unit is resharded and the step's unsharded gradients dropped instead (nothing of them
    reaches a later reduce). Needs ``reshard_after_forward_mode = "never"``; nothing happens for
    a model without FSDP."""
    if not isinstance(model, FSDPModule):
        yield
        return
    if any(group.post_forward_mesh_info is not None for module in model.modules() if isinstance(module, FSDPModule)
           for group in _param_groups(module._get_fsdp_state())):
        raise ValueError("a split-backward schedule needs every FSDP unit gathered from its forward to its weight "
                         "pass: expected reshard_after_forward_mode 'never'")
    _backward_defaults(model, False)
    try:
        yield
    except BaseException:
        _backward_defaults(model, True)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in _param_groups(module._get_fsdp_state()):
                    for param in group.fsdp_params:
                        param.unsharded_accumulated_grad = None
                        if hasattr(param, "_unsharded_param"):
                            param.unsharded_param.grad = None
        model.reshard()
        raise
    _backward_defaults(model, True)
    state = fully_shard.state(model)  # type: ignore[attr-defined]
    # (last unit first, as FSDP's own end of backward: its reduce-scatter is the first ready;
    # as torch.distributed.pipelining does for a stage that is its own FSDP root)
    for unit in reversed(state._state_ctx.all_states):
        for group in reversed(_param_groups(unit)):
            group.post_backward()
    state._root_post_backward_final_callback()

