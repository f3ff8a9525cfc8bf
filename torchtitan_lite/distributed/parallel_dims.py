"""A job's parallel degrees by name, resolved against the world size. Pure logic: no process
group needed.

The ranks form a mesh of named dimensions, outermost first (TorchTitan's order): ``pp`` (pipeline
stages: each pipeline coordinate holds other layers), ``dp_replicate`` (HSDP replicas),
``dp_shard`` (FSDP), ``cp`` (context parallel) and ``tp`` (tensor parallel), ``tp`` innermost, so
that a tensor-parallel group is made of contiguous ranks (one node's fast links). The data-parallel
dimensions are ``dp_replicate × dp_shard``: every rank of one data-parallel coordinate reads the
same batch; ``dp_rank`` / ``dp_size`` say which batch and of how many. Expert parallelism (``ep``)
borrows its ranks from ``dp_shard``, as TorchTitan's does: the mesh splits ``dp_shard`` into
``dp_shard_mod_ep × ep`` (:attr:`ParallelDims.mesh_dims`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEGREE_KEYS", "MESH_DIMS", "ParallelDims"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, outermost first."""

DEGREE_KEYS = {"dp_replicate": "parallelism.data_parallel_replicate_degree",
         "dp_shard": "parallelism.data_parallel_shard_degree",
         "cp": "parallelism.context_parallel_degree",
         "tp": "parallelism.tensor_parallel_degree",
         "ep": "parallelism.expert_parallel_degree",
         "pp": "parallelism.pipeline_parallel_degree"}
"""Each degree's config key."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees resolved against the world size (``-1`` already filled in)."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def unsupported(self) -> str | None:
        """A combination of degrees the build does not run yet, as one line naming the key, or
        None: expert parallel beside tensor parallel, or over fewer ranks than a sequence is split
        over (the one place of the rules; the plan refuses them before any process group, the mesh
        if it gets that far)."""
        if self.ep > 1 and self.tp > 1:
            return (f"{DEGREE_KEYS['tp']}: invalid value {self.tp}; tensor parallel is not combined "
                    f"with expert parallel ({DEGREE_KEYS['ep']} > 1) yet; expected 1 with it")
        if self.ep > 1 and self.cp > 1 and self.ep % self.cp:
            return (f"{DEGREE_KEYS['ep']}: invalid value {self.ep}; with context parallel the expert-parallel "
                    f"ranks are the {DEGREE_KEYS['cp']} = {self.cp} ranks of a sequence and data-parallel ones: "
                    "expected a multiple of it")
        return None

    @staticmethod
    def check_degrees(*, dp_replicate: int, dp_shard: int, cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1) -> None:
        """Each data-parallel degree is >= 1 or -1 ("the rest of the world"), and not both -1; the
        replicate degree may also be 0 ("one replica per node"); the others are >= 1."""
        if dp_replicate < -1:
            raise ValueError(f"{DEGREE_KEYS['dp_replicate']}={dp_replicate} must be >= 1, -1 (the rest of the world) "
                             "or 0 (one replica per node)")
        if dp_shard == 0 or dp_shard < -1:
            raise ValueError(f"{DEGREE_KEYS['dp_shard']}={dp_shard} must be >= 1 or -1")
        if dp_replicate == -1 and dp_shard == -1:
            raise ValueError(f"{DEGREE_KEYS['dp_replicate']} and data_parallel_shard_degree cannot both be -1")
        for name, value in (("cp", cp), ("tp", tp), ("ep", ep), ("pp", pp)):
            if value < 1:
                raise ValueError(f"{DEGREE_KEYS[name]}={value} must be >= 1")

    @classmethod
    def resolve(cls, *, dp_replicate: int, dp_shard: int, world_size: int, local_world_size: int | None = None,
                cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1) -> ParallelDims:
        """Fill in a ``-1`` degree and check ``dp_replicate × dp_shard × cp × tp == world_size``.

        ``dp_replicate = 0`` means one replica per node: with ``dp_shard = -1``, parameters are
        sharded over the ranks of a node (its fast links carry the all-gathers and
        reduce-scatters) and replicated across the ``world_size / local_world_size`` nodes (only
        gradient all-reduces cross nodes); with a given ``dp_shard`` it is the rest of the world.
        torchrun numbers the ranks of a node contiguously, and the inner dimensions of the mesh are
        made of contiguous ranks. ``ep`` must divide ``dp_shard × cp``. ``pp``, the outermost
        dimension, takes its share first (with it, ``dp_replicate = 0`` is one replica).

        Raises ``ValueError`` naming the keys and values when they do not fit.
        """
        cls.check_degrees(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, pp=pp)
        inner = cp * tp
        if world_size % inner:
            raise ValueError(f"{DEGREE_KEYS['cp']}={cp} × {DEGREE_KEYS['tp']}={tp} = {inner} does not divide the world "
                             f"size {world_size}")
        if world_size % (inner * pp):
            factors = [f"{DEGREE_KEYS[n]}={v}" for n, v in (("pp", pp), ("cp", cp), ("tp", tp)) if n == "pp" or v > 1]
            product = f" = {inner * pp}" if len(factors) > 1 else ""  # (one factor: its value says it)
            raise ValueError(f"{' × '.join(factors)}{product} does not divide the world size {world_size}")
        dp_world = world_size // (inner * pp)
        if dp_replicate == 0 and pp > 1:
            dp_replicate = -1 if dp_shard != -1 else 1
        if dp_replicate == 0:
            local = local_world_size or world_size
            nodes = world_size // local if local and world_size % local == 0 else 1
            dp_replicate = -1 if dp_shard != -1 else nodes
        if -1 in (dp_replicate, dp_shard):
            name, known = ("dp_replicate", dp_replicate) if dp_shard == -1 else ("dp_shard", dp_shard)
            if dp_world % known:
                rest = (f" / (pipeline × context × tensor parallel = {inner * pp})" if pp > 1
                        else f" / (context × tensor parallel = {inner})" if inner > 1 else "")
                raise ValueError(f"{DEGREE_KEYS[name]}={known} does not divide the world size {world_size}{rest}")
            rest_of_world = dp_world // known
            dp_replicate, dp_shard = (known, rest_of_world) if dp_shard == -1 else (rest_of_world, known)
        if dp_replicate * dp_shard * inner * pp != world_size:
            others = "".join(f" × {DEGREE_KEYS[n]}={v}" for n, v in (("cp", cp), ("tp", tp), ("pp", pp)) if v > 1)
            raise ValueError(
                f"{DEGREE_KEYS['dp_shard']}={dp_shard} × {DEGREE_KEYS['dp_replicate']}={dp_replicate}{others} = "
                f"{dp_replicate * dp_shard * inner * pp} does not equal the world size {world_size}")
        if (dp_shard * cp) % ep:
            raise ValueError(f"{DEGREE_KEYS['ep']}={ep} does not divide data_parallel_shard_degree × "
                             f"context_parallel_degree = {dp_shard * cp}")
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=world_size, cp=cp, tp=tp, ep=ep, pp=pp)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel coordinate of global ``rank`` (which batch it reads)."""
        return (rank % (self.world_size // self.pp)) // (self.cp * self.tp)

    def pp_rank(self, rank: int) -> int:
        """The pipeline coordinate of global ``rank`` (which stages it holds)."""
        return rank // (self.world_size // self.pp)

    def degree(self, name: str) -> int:
        """The degree of dimension ``name`` (one of :data:`MESH_DIMS`, or ``ep``)."""
        return int(getattr(self, name))

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The dimensions the mesh is built with, outermost first: ``dp_shard`` always (the
        FSDP dimension, 1 on one process), the others where their degree is above 1. With expert
        parallel (and no context parallel) ``dp_shard`` is built as ``dp_shard_mod_ep × ep``: the
        expert-parallel ranks are the inner, contiguous part of the FSDP ranks, and the experts'
        weights are FSDP-sharded over ``dp_shard_mod_ep`` (with ``dp_replicate``)."""
        dims = tuple((name, self.degree(name)) for name in MESH_DIMS if name == "dp_shard" or self.degree(name) > 1)
        if self.ep > 1 and self.cp == 1:
            dims = tuple(part for name, size in dims
                         for part in ((("dp_shard_mod_ep", size // self.ep), ("ep", self.ep)) if name == "dp_shard"
                                      else ((name, size),)))
        elif self.ep > 1:  # ep = dp_shard_in_ep × cp: the context-parallel ranks and some data-parallel ones
            inner = self.ep // self.cp
            dims = tuple(part for name, size in dims
                         for part in ((("dp_shard_mod_ep", size // inner), ("dp_shard_in_ep", inner))
                                      if name == "dp_shard" else ((name, size),)))
        return dims

    def beyond_data_parallel(self) -> dict[str, int]:
        """The degrees above 1 of dimensions other than data parallel (``pp``, ``cp``, ``tp``, ``ep``)."""
        return {name: self.degree(name) for name in ("pp", "cp", "tp", "ep") if self.degree(name) > 1}
