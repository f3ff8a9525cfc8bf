"""Process groups, meshes and parallelisms: :mod:`.parallel_dims` (degrees by name), :mod:`.mesh`
(the named mesh, its FSDP submesh and data-parallel group), :mod:`.process_group` (process group,
device, timeouts) and :mod:`.fsdp` (``apply_fsdp``: FSDP2 units, reshard
policy, mixed precision, CPU offload)."""

from torchtitan_lite.distributed.mesh import ParallelMesh, build_mesh, fsdp_mesh
from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.process_group import (
    backend_for,
    choose_device,
    destroy_distributed,
    forget_dtensor_plans,
    free_port,
    init_distributed,
    local_world_size_from_env,
    release_process_groups,
    set_collective_timeout,
    world_info_from_env,
)

__all__ = ["ParallelDims", "ParallelMesh", "backend_for", "build_mesh", "choose_device", "destroy_distributed",
           "forget_dtensor_plans", "free_port",
           "fsdp_mesh", "init_distributed", "local_world_size_from_env", "release_process_groups",
           "set_collective_timeout", "world_info_from_env"]
