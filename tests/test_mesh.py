"""The named mesh (``torchtitan_lite/distributed/parallel_dims.py``, ``mesh.py``): degrees by name,
the data-parallel rank, and a job with a second dimension beside data parallel."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import run_distributed
from torchtitan_lite.distributed.parallel_dims import ParallelDims


def test_degrees_resolve_by_name() -> None:
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, tp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size) == (1, 4, 2, 4)
    assert dims.mesh_dims == (("dp_shard", 4), ("tp", 2))
    # tp innermost: ranks 0 and 1 are one tensor-parallel pair and read the same batch.
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = ParallelDims.resolve(dp_replicate=2, dp_shard=-1, cp=2, tp=2, ep=2, world_size=16)
    assert dims.mesh_dims == (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2))
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


def _replicated_on_tp() -> Any:
    """A test family: Llama 3 whose parallelize accepts a tensor-parallel dimension and adds
    nothing on it (the model is replicated over it)."""
    from torchtitan_lite.distributed.parallelize import default_parallelize
    from torchtitan_lite.models import LLAMA3_SPEC

    def parallelize(spec: Any, model: Any, mesh: Any, options: Any, *, device: Any) -> Any:
        assert mesh is None or "tp" in mesh.names
        return default_parallelize(spec, model, mesh, options, device=device)

    return dataclasses.replace(LLAMA3_SPEC, name="llama3_tp_replicated", parallelize=parallelize,
                               parallel_dims=frozenset({"tp"}))


def _train_recording(argv: list[str], register: bool) -> dict[str, Any]:
    """Train; the losses, the windows this rank read each step, its mesh and its parameters'
    placements."""
    import torch.distributed as dist

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.models import register_model_spec
    from torchtitan_lite.trainer import Trainer

    if register:
        register_model_spec(_replicated_on_tp(), replace=True)
    trainer = Trainer(load_job_config(argv))
    reads: list[list[int]] = []
    original = trainer.train_step

    def recording_step() -> dict[str, float]:
        reader, per_rank = trainer.loader.sources[0].reader, trainer.loader.global_batch_size // trainer.loader.dp_size
        first = trainer.loader.step * trainer.loader.global_batch_size + trainer.loader.dp_rank * per_rank
        reads.append([reader.index(first + i) for i in range(per_rank)])
        return original()

    trainer.train_step = recording_step  # type: ignore[method-assign]
    try:
        history = trainer.train()
        placements = {name: (tuple(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements],
                             tuple(p.device_mesh.mesh.tolist()))
                      for name, p in list(trainer.model.named_parameters())[:2]}
        return {"losses": [h["loss"] for h in history], "reads": reads, "mesh": trainer.mesh.describe(),
                "dp_rank": trainer.mesh.dp_rank, "rank": dist.get_rank(), "placements": placements}
    finally:
        trainer.close()


def test_a_second_dimension_replicating_the_model_trains_as_data_parallel_alone(tmp_path) -> None:
    """World size 4 as data-parallel 2 × tensor-parallel 2, on a family that adds nothing on the
    tensor-parallel dimension: the losses of the data-parallel-2 job within 1e-6 over 10 steps;
    each global batch read once per data-parallel rank (the two ranks of a pair read the same);
    parameters sharded over the data-parallel dimension only."""
    common = [*TINY_ARGS, "--training.steps", "10", "--training.global_batch_size", "4",
              "--metrics.no-enable_tensorboard", "--validation.no-enable"]
    two = run_distributed(_train_recording, 2, [*common, "--job.dump_folder", str(tmp_path / "dp2")], False)
    four = run_distributed(_train_recording, 4, [*common, "--job.dump_folder", str(tmp_path / "dp2tp2"),
                                                 "--model.name", "llama3_tp_replicated",
                                                 "--parallelism.tensor_parallel_degree", "2"], True)
    assert [r["mesh"] for r in four] == [{"dp_shard": 2, "tp": 2}] * 4
    assert [r["dp_rank"] for r in four] == [0, 0, 1, 1]
    for result in four:
        for got, want in zip(result["losses"], two[0]["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (result["losses"], two[0]["losses"])
        assert result["reads"] == two[result["dp_rank"]]["reads"]
    # FSDP shards over the data-parallel dimension only: ranks 0 and 2 (tp coordinate 0) together.
    for name, (dims, placements, ranks) in four[0]["placements"].items():
        assert dims == ("dp_shard",) and placements == ["S(0)"] and ranks == (0, 2), name
    assert four[1]["placements"][next(iter(four[1]["placements"]))][2] == (1, 3)
