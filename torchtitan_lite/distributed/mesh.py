"""The job's device mesh with named dimensions (:class:`ParallelMesh`): the FSDP submesh, the
data-parallel group that losses, metrics, validation and data use, and any other dimension by name."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_lite.distributed.parallel_dims import ParallelDims

__all__ = ["ParallelMesh", "build_mesh", "fsdp_mesh"]

_DATA_PARALLEL = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelMesh:
    """The world's mesh (``dims.mesh_dims``, outermost first), the submesh FSDP shards over, and the
    data-parallel group.

    - ``fsdp``: ``("dp_shard",)``, or ``("dp_replicate", "dp_shard")`` for HSDP (``dp_shard_cp``,
      ``dp_shard × cp`` flattened, in place of ``dp_shard`` with context parallel); the world mesh
      itself when there is no other dimension.
    - ``dp_group``: the ranks that read different batches of one step and whose losses, token
      counts and validation sums add up: the default (world) group when every dimension is data
      parallel, else the data-parallel dimensions' group (flattened for HSDP).
    - ``[name]``: the submesh of one dimension (``"tp"`` …) for a family's parallelize step.
    """

    world: DeviceMesh
    fsdp: DeviceMesh
    dims: ParallelDims
    dp_group: Any
    experts: DeviceMesh | None = None
    """With expert parallel: the mesh the experts' weights are FSDP-sharded over (``dp_shard_mod_ep``,
    with ``dp_replicate`` for HSDP); the experts themselves split over ``self["ep"]``."""
    token_group: Any = None
    """The ranks whose tokens make up one global batch, over which losses and token counts add up:
    data parallel × context parallel (None: :attr:`dp_group`, when there is no context parallel)."""

    @property
    def tokens(self) -> Any:
        """:attr:`token_group`, or :attr:`dp_group` without context parallel."""
        return self.dp_group if self.token_group is None else self.token_group

    @property
    def dp_rank(self) -> int:
        """Which batch this rank reads (its data-parallel coordinate)."""
        return self.dims.dp_rank(dist.get_rank())

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def pp_rank(self) -> int:
        """Which pipeline stages this rank holds (its pipeline coordinate; 0 without a pipeline)."""
        return self.dims.pp_rank(dist.get_rank())

    @property
    def pp_group(self) -> Any:
        """The pipeline ranks of this rank's data-parallel coordinate (None without a pipeline)."""
        return self.world["pp"].get_group() if self.dims.pp > 1 else None

    @property
    def split_dims(self) -> tuple[str, ...]:
        """The dimensions beyond data parallel the model is split over (``tp``, ``cp``, ``ep``
        with a degree above 1; ``ep`` may be a flattened dimension of the mesh)."""
        return tuple(name for name in ("tp", "cp", "ep") if self.dims.degree(name) > 1)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.world.mesh_dim_names or ())

    def __getitem__(self, name: str) -> DeviceMesh:
        """The submesh of dimension ``name``: one the mesh was built with, or ``ep`` flattened
        from ``dp_shard_in_ep × cp`` (expert parallel beside context parallel)."""
        if name not in self.names and name not in self.split_dims:
            raise KeyError(f"the mesh has no dimension {name!r} (it has {', '.join(self.names)})")
        return self.world[name] if name in self.names else _slice(self.world, name)

    def groups(self) -> list[Any]:
        """Every process group collectives run on (what the collective timeouts are set on): each
        dimension's, the FSDP mesh's (flattened ones included), the experts', the expert-parallel
        one, the data-parallel and the token groups; each once."""
        found = [self.world.get_group(dim) for dim in range(self.world.ndim)]
        found += [self.fsdp.get_group(dim) for dim in range(self.fsdp.ndim)]
        if self.experts is not None:
            found += [self.experts.get_group(dim) for dim in range(self.experts.ndim)]
        if "ep" in self.split_dims:
            found.append(self["ep"].get_group())
        found += [self.dp_group, self.tokens]
        unique: dict[int, Any] = {}
        for group in found:
            unique.setdefault(id(group), group)
        return list(unique.values())

    def describe(self) -> dict[str, int]:
        """Each dimension's size, outermost first (for the log)."""
        return dict(zip(self.names, self.world.shape, strict=True))


def _slice(world: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """``world[names]`` where ``names`` mixes a dimension of ``world`` with one flattened from it
    (HSDP's ``("dp_replicate", "dp_shard_cp")``), or a flattened one by its name: the only way that every
    supported torch has. torch 2.13 warns that such slicing "will be deprecated"; the warning
    is for this call alone, so it is not shown to every job."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return world[names]


def build_mesh(device: torch.device, dims: ParallelDims) -> ParallelMesh:
    """The mesh of ``dims`` over the initialised default process group (a collective: every rank
    calls it). Plans DTensor cached for an earlier mesh of the same shape are dropped first
    (:func:`~torchtitan_lite.distributed.process_group.forget_dtensor_plans`)."""
    from torchtitan_lite.distributed.process_group import forget_dtensor_plans

    forget_dtensor_plans()
    problem = dims.unsupported()
    if problem is not None:
        raise ValueError(problem)
    names, shape = zip(*dims.mesh_dims, strict=True)
    world = init_device_mesh(device.type, tuple(shape), mesh_dim_names=tuple(names))
    data = tuple(n for n in names if n in _DATA_PARALLEL)
    if "ep" in names:  # the rest of the model is FSDP-sharded over dp_shard = dp_shard_mod_ep × ep
        replicate = ("dp_replicate",) if "dp_replicate" in names else ()
        experts = world[(*replicate, "dp_shard_mod_ep")] if replicate else world["dp_shard_mod_ep"]
        # dp_shard: the two dimensions flattened (no new process groups beyond the flattened one)
        flat = world[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
        fsdp = _slice(world, (*replicate, "dp_shard")) if replicate else flat
        # (data parallel is the world, but with a pipeline: then each pipeline rank's share)
        dp_group = (dist.group.WORLD if dims.pp == 1 else fsdp._flatten("dp").get_group() if replicate
                    else fsdp.get_group())
        return ParallelMesh(world=world, fsdp=fsdp, dims=dims, dp_group=dp_group, experts=experts)
    if "cp" in names and dims.ep > 1:
        # Expert parallel over dp_shard_in_ep × cp (the ep dimension, flattened); the experts'
        # weights FSDP-sharded over dp_shard_mod_ep, everything else over all three.
        replicate = ("dp_replicate",) if "dp_replicate" in names else ()
        world[("dp_shard_in_ep", "cp")]._flatten("ep")
        flat = world[("dp_shard_mod_ep", "dp_shard_in_ep", "cp")]._flatten("dp_shard_cp")
        fsdp = _slice(world, (*replicate, "dp_shard_cp")) if replicate else flat
        experts = world[(*replicate, "dp_shard_mod_ep")] if replicate else world["dp_shard_mod_ep"]
        dp_group = world[(*replicate, "dp_shard_mod_ep", "dp_shard_in_ep")]._flatten("dp").get_group()
        # (the world's ranks, but with a pipeline: each pipeline rank's share)
        token = dist.group.WORLD if dims.pp == 1 else world[(*replicate, "dp_shard_mod_ep", "dp_shard_in_ep",
                                                              "cp")]._flatten("dp_cp").get_group()
        return ParallelMesh(world=world, fsdp=fsdp, dims=dims, dp_group=dp_group, experts=experts,
                            token_group=token)
    if "cp" in names:  # parameters sharded over dp_shard × cp: every rank of a sequence holds a shard
        replicate = ("dp_replicate",) if "dp_replicate" in names else ()
        flat = world[("dp_shard", "cp")]._flatten("dp_shard_cp")
        fsdp = _slice(world, (*replicate, "dp_shard_cp")) if replicate else flat
        dp_group = (world[data]._flatten("dp").get_group() if len(data) == 2 else world[data[0]].get_group())
        # (the world's ranks, but with tensor parallel or a pipeline: each such rank's share)
        alone = "tp" not in names and "pp" not in names
        token = dist.group.WORLD if alone else world[(*data, "cp")]._flatten("dp_cp").get_group()
        return ParallelMesh(world=world, fsdp=fsdp, dims=dims, dp_group=dp_group, token_group=token)
    if data == names:  # data parallel only: as FSDP always had it, and every collective on the world
        fsdp, dp_group = world, dist.group.WORLD
    elif len(data) == 1:
        fsdp = world[data[0]]
        dp_group = fsdp.get_group()
    else:
        fsdp = world[data]
        dp_group = fsdp._flatten("dp").get_group()
    return ParallelMesh(world=world, fsdp=fsdp, dims=dims, dp_group=dp_group)


def fsdp_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D ``("dp_shard",)`` mesh over every rank of the initialised default process group."""
    return build_mesh(device, ParallelDims.resolve(dp_replicate=1, dp_shard=-1, world_size=dist.get_world_size())).fsdp
