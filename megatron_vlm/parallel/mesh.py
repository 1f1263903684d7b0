"""The device mesh: ("dp_replicate", "dp_shard") today; tp / ep / cp dims join it later."""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard


def build_mesh(parallel_cfg, world_size: int, device_type: str) -> tuple[ParallelDims, DeviceMesh]:
    rep = parallel_cfg.dp_replicate
    shard = parallel_cfg.dp_shard if parallel_cfg.dp_shard != -1 else world_size // rep
    if rep * shard != world_size:
        raise ValueError(
            f"parallel.dp_replicate ({rep}) x parallel.dp_shard ({shard}) = {rep * shard} "
            f"does not equal the number of processes ({world_size})"
        )
    dims = ParallelDims(rep, shard, world_size)
    mesh = init_device_mesh(device_type, (rep, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return dims, mesh
