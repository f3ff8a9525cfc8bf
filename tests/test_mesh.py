"""The named mesh (``torchtitan_lite/distributed/parallel_dims.py``, ``mesh.py``): degrees by name
and the data-parallel rank. (Jobs with a second dimension beside data parallel: the
tensor-parallel and expert-parallel tests.)"""

from __future__ import annotations

import pytest

from torchtitan_lite.distributed.parallel_dims import ParallelDims


def test_degrees_resolve_by_name() -> None:
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, tp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size) == (1, 4, 2, 4)
    assert dims.mesh_dims == (("dp_shard", 4), ("tp", 2))
    # tp innermost: ranks 0 and 1 are one tensor-parallel pair and read the same batch.
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = ParallelDims.resolve(dp_replicate=2, dp_shard=-1, cp=2, tp=2, ep=2, world_size=16)
    # (expert parallel over dp_shard_in_ep × cp: here the two ranks of a sequence)
    assert dims.mesh_dims == (("dp_replicate", 2), ("dp_shard_mod_ep", 2), ("dp_shard_in_ep", 1), ("cp", 2), ("tp", 2))
    assert dims.dp_size == 4 and dims.beyond_data_parallel() == {"cp": 2, "tp": 2, "ep": 2}
    # One replica per node (replicate degree 0) shards within a node, less the tensor-parallel ranks.
    dims = ParallelDims.resolve(dp_replicate=0, dp_shard=-1, tp=2, world_size=16, local_world_size=8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)
    # Data parallel only: the mesh is what it always was.
    assert ParallelDims.resolve(dp_replicate=1, dp_shard=-1, world_size=4).mesh_dims == (("dp_shard", 4),)
    for kwargs, message in [
        ({"tp": 3, "world_size": 8}, "parallelism.context_parallel_degree=1 × parallelism.tensor_parallel_degree=3 = "
                                     "3 does not divide the world size 8"),
        ({"tp": 0, "world_size": 8}, "parallelism.tensor_parallel_degree=0 must be >= 1"),
        ({"tp": 2, "dp_shard": 3, "dp_replicate": -1, "world_size": 8},
         "parallelism.data_parallel_shard_degree=3 does not divide the world size 8 / (context × tensor parallel = 2)"),
        ({"tp": 2, "dp_shard": 3, "world_size": 8},
         "parallelism.data_parallel_shard_degree=3 × parallelism.data_parallel_replicate_degree=1 × "
         "parallelism.tensor_parallel_degree=2 = 6 does not equal the world size 8"),
        ({"ep": 3, "world_size": 4}, "parallelism.expert_parallel_degree=3 does not divide "
                                     "data_parallel_shard_degree × context_parallel_degree = 4"),
    ]:
        with pytest.raises(ValueError) as info:
            ParallelDims.resolve(**{"dp_replicate": 1, "dp_shard": -1, **kwargs})
        assert str(info.value) == message
