"""Everything the tests read from FSDP2's private state, in one place.

``fully_shard`` exposes no public way to ask which parameters a unit owns, what it will do
after forward, or whether it offloads: those live in ``module._get_fsdp_state()`` and its
``_fsdp_param_group`` (``torch.distributed.fsdp._fully_shard``). The tests assert on them
because they are what FSDP2 will actually do, not what our code asked for. When a PyTorch
release moves them, this module is the only one to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

__all__ = [
    "count_unshards",
    "distinct_post_forward_meshes",
    "has_root_params",
    "offload_flags",
    "reshard_kind",
    "same_unit",
    "unit_param_names",
]


def _param_group(module: nn.Module) -> Any | None:
    """The unit's ``FSDPParamGroup`` (None for a module without parameters of its own, such as
    a root that only schedules its children, or for a module that is not an FSDP unit)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return module._get_fsdp_state()._fsdp_param_group


def unit_param_names(module: nn.Module) -> list[str] | None:
    """Sorted names of the parameters the unit of ``module`` owns (names are assigned at FSDP's
    lazy init, i.e. by the first forward); None when ``module`` is not an FSDP unit."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    group = _param_group(module)
    return [] if group is None else sorted(fp._param_fqn for fp in group.fsdp_params)


def reshard_kind(module: nn.Module) -> str | int:
    """Reshard-after-forward as FSDP2 will do it for ``module``'s unit: ``"none"`` (kept
    unsharded), ``"full"`` (resharded to the whole shard group) or the size of the smaller group
    it reshards to (an integer ``reshard_after_forward``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    group = _param_group(module)
    if group is None:
        return "not a unit"
    info = group.post_forward_mesh_info
    if info is None:
        return "none"
    if info is group.mesh_info or info == group.mesh_info:
        return "full"
    if isinstance(info, HSDPMeshInfo):
        return int(info.shard_mesh_size)
    return f"unexpected {info!r}"


def distinct_post_forward_meshes(modules: Mapping[str, nn.Module] | list[nn.Module]) -> int:
    """How many separate post-forward meshes (other than a unit's own) the units use: units
    resharding to the same smaller group should share one."""
    values = modules.values() if isinstance(modules, Mapping) else modules
    groups = [g for g in map(_param_group, values) if g is not None]
    return len({id(g.post_forward_mesh_info) for g in groups
                if g.post_forward_mesh_info is not None and g.post_forward_mesh_info is not g.mesh_info})


def same_unit(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` are sharded, gathered and freed as one FSDP unit."""
    return a._get_fsdp_state() is b._get_fsdp_state()


def has_root_params(model: nn.Module) -> bool:
    """Whether the root unit owns parameters (i.e. some were left out of every named unit)."""
    return _param_group(model) is not None


def offload_flags(modules: list[nn.Module]) -> list[tuple[bool, bool]]:
    """``(offload_to_cpu, pin_memory)`` of every parameter of the units of ``modules``."""
    return [(fp.offload_to_cpu, fp.pin_memory)
            for g in map(_param_group, modules) if g is not None for fp in g.fsdp_params]


@contextlib.contextmanager
def count_unshards(units: Mapping[str, nn.Module], on_unshard: Callable[[str | None], str | None]
                   ) -> Iterator[None]:
    """While active, every all-gather a unit issues runs inside ``on_unshard(name)``'s label:
    ``on_unshard`` is called with the unit's name before its ``unshard`` and with the returned
    previous label afterwards, so collectives recorded in between can be attributed to it."""
    groups = {name: g for name, g in ((n, _param_group(m)) for n, m in units.items()) if g is not None}
    for name, group in groups.items():
        original = group.unshard

        def labelled(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            previous = on_unshard(_name)
            try:
                return _original(*args, **kwargs)
            finally:
                on_unshard(previous)

        group.unshard = labelled
    try:
        yield
    finally:
        for group in groups.values():
            del group.unshard  # back to the class's method
