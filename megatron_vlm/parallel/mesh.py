"""The device meshes: ("dp_replicate", "dp_shard") for FSDP2 / HSDP over all ranks, and, with expert
parallelism, ("ep_replicate", "ep") for the routed experts; tp / cp dims join later.

Expert-parallel ranks are data-parallel ranks too: every rank reads its own data and holds the
non-expert parameters through FSDP over the whole world. The routed experts are instead sharded over
groups of `ep` consecutive ranks (the "ep" dim) and replicated over the `world / ep` such groups (the
"ep_replicate" dim); they are excluded from FSDP (see `parallel_plan.make_parallelize`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    ep: int = 1

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
    ep = getattr(parallel_cfg, "ep", 1)
    if ep < 1 or world_size % ep:
        raise ValueError(f"parallel.ep ({ep}) must be >= 1 and divide the number of processes ({world_size})")
    dims = ParallelDims(rep, shard, world_size, ep)
    mesh = init_device_mesh(device_type, (rep, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return dims, mesh


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """("ep_replicate", "ep") = (world / ep, ep) over all ranks: rank r holds expert shard r % ep.
    Collective: every rank must call it."""
    if dims.ep < 1 or dims.world_size % dims.ep:
        raise ValueError(f"parallel.ep ({dims.ep}) must be >= 1 and divide the number of processes ({dims.world_size})")
    return init_device_mesh(device_type, (dims.world_size // dims.ep, dims.ep), mesh_dim_names=("ep_replicate", "ep"))
