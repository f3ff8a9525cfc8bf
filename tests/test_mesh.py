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
        ({"pp": 2, "world_size": 1}, "parallelism.pipeline_parallel_degree=2 does not divide the world size 1"),
        ({"pp": 2, "tp": 2, "world_size": 6},
         "parallelism.pipeline_parallel_degree=2 × parallelism.tensor_parallel_degree=2 = 4 does not divide the "
         "world size 6"),
    ]:
        with pytest.raises(ValueError) as info:
            ParallelDims.resolve(**{"dp_replicate": 1, "dp_shard": -1, **kwargs})
        assert str(info.value) == message


def _mesh_warnings() -> list[str]:
    """Build the meshes that slice flattened dimensions (context parallel, HSDP with it, expert
    parallel beside it, expert parallel alone) on 4 ranks; every warning they raise."""
    import warnings

    import torch
    import torch.distributed as dist

    from torchtitan_lite.distributed import init_distributed
    from torchtitan_lite.distributed.mesh import build_mesh

    init_distributed(torch.device("cpu"))
    cases = [dict(cp=4), dict(dp_replicate=2, cp=2), dict(cp=2, ep=2), dict(ep=2), dict(dp_replicate=2, ep=2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in cases:
            kwargs = {"dp_replicate": 1, "dp_shard": -1, **case}
            mesh = build_mesh(torch.device("cpu"), ParallelDims.resolve(**kwargs, world_size=dist.get_world_size()))
            mesh.groups()
            for name in mesh.split_dims:
                mesh[name]
    return [str(w.message) for w in caught]


def test_no_deprecation_warning_from_the_meshes_of_context_and_expert_parallel() -> None:
    """torch 2.13 warns on each slice of a flattened dimension from the root mesh ("Slicing a
    flattened dim ... will be deprecated"): a context-parallel job printed it twice."""
    from tests.dist_utils import run_distributed

    for caught in run_distributed(_mesh_warnings, 4):
        assert not [w for w in caught if "flattened" in w or "deprecat" in w], caught
