"""Process groups, meshes and parallelisms: :mod:`.parallel_dims` (degrees), :mod:`.process_group`
(process group, device, mesh, timeouts) and :mod:`.fsdp` (``apply_fsdp``: FSDP2 units, reshard
policy, mixed precision, CPU offload)."""

from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.process_group import (
    backend_for,
    build_mesh,
    choose_device,
    destroy_distributed,
    forget_dtensor_plans,
    free_port,
    fsdp_mesh,
    init_distributed,
    local_world_size_from_env,
    release_process_groups,
    set_collective_timeout,
    world_info_from_env,
)

__all__ = ["ParallelDims", "backend_for", "build_mesh", "choose_device", "destroy_distributed",
           "forget_dtensor_plans", "free_port",
           "fsdp_mesh", "init_distributed", "local_world_size_from_env", "release_process_groups",
           "set_collective_timeout", "world_info_from_env"]
