"""Data-parallel degrees: ``parallelism.data_parallel_{replicate,shard}_degree`` resolved against
the world size. Pure logic: no process group needed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """Data-parallel degrees resolved against the world size (``-1`` already filled in)."""

    dp_replicate: int
    dp_shard: int
    world_size: int

    @staticmethod
    def check_degrees(*, dp_replicate: int, dp_shard: int) -> None:
        """Each degree is >= 1 or -1 ("the rest of the world"), and not both -1; the replicate
        degree may also be 0 ("one replica per node")."""
        if dp_replicate < -1:
            raise ValueError(f"parallelism.data_parallel_replicate_degree={dp_replicate} must be >= 1, "
                             "-1 (the rest of the world) or 0 (one replica per node)")
        if dp_shard == 0 or dp_shard < -1:
            raise ValueError(f"parallelism.data_parallel_shard_degree={dp_shard} must be >= 1 or -1")
        if dp_replicate == -1 and dp_shard == -1:
            raise ValueError(
                "parallelism.data_parallel_replicate_degree and data_parallel_shard_degree "
                "cannot both be -1"
            )

    @classmethod
    def resolve(cls, *, dp_replicate: int, dp_shard: int, world_size: int,
                local_world_size: int | None = None) -> ParallelDims:
        """Fill in a ``-1`` degree and check ``dp_replicate × dp_shard == world_size``.

        ``dp_replicate = 0`` means one replica per node: with ``dp_shard = -1``, parameters are
        sharded over the ``local_world_size`` ranks of a node (its fast links carry the
        all-gathers and reduce-scatters) and replicated across the ``world_size /
        local_world_size`` nodes (only gradient all-reduces cross nodes); with a given
        ``dp_shard`` it is the rest of the world. torchrun numbers the ranks of a node
        contiguously, and the mesh's inner (shard) dimension is made of contiguous ranks.

        Raises ``ValueError`` naming the keys and values when they do not fit.
        """
        cls.check_degrees(dp_replicate=dp_replicate, dp_shard=dp_shard)
        if dp_replicate == 0:
            local = local_world_size or world_size
            nodes = world_size // local if local and world_size % local == 0 else 1
            dp_replicate = -1 if dp_shard != -1 else nodes
        if -1 in (dp_replicate, dp_shard):
            key, known = ("replicate", dp_replicate) if dp_shard == -1 else ("shard", dp_shard)
            if world_size % known:
                raise ValueError(
                    f"parallelism.data_parallel_{key}_degree={known} does not divide the world "
                    f"size {world_size}"
                )
            rest = world_size // known
            dp_replicate, dp_shard = (known, rest) if dp_shard == -1 else (rest, known)
        if dp_replicate * dp_shard != world_size:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree={dp_shard} × "
                f"parallelism.data_parallel_replicate_degree={dp_replicate} = "
                f"{dp_replicate * dp_shard} does not equal the world size {world_size}"
            )
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, world_size=world_size)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard
