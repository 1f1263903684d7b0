"""The device meshes: ("dp_replicate", "dp_shard") for FSDP2 / HSDP over all ranks, and, with expert
parallelism, ("ep_replicate", "ep") for the routed experts; tp / cp dims join later.

Expert-parallel ranks are data-parallel ranks too: every rank reads its own data and holds the
non-expert parameters through FSDP over the whole world. The routed experts are instead sharded over
groups of `ep` consecutive ranks (the "ep" dim) and replicated over the `world / ep` such groups (the
"ep_replicate" dim); they are excluded from FSDP (see `parallel_plan.make_parallelize`).

Context parallelism adds the innermost dim "cp" (`parallel.cp` consecutive ranks split the tokens of
the same packs): the mesh is ("dp_replicate", "dp_shard", "cp"), the data-parallel rank of a process is
`rank // cp`, and FSDP shards over dp_shard x cp flattened ("dp_shard_cp"; parallel/context_parallel.py).
`parallel.pp` > 1 is refused by the config (not implemented).
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
    cp: int = 1
    pp: int = 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (the ranks of one cp group read the same data)."""
        return rank // self.cp


def build_mesh(parallel_cfg, world_size: int, device_type: str) -> tuple[ParallelDims, DeviceMesh]:
    rep = parallel_cfg.dp_replicate
    cp = getattr(parallel_cfg, "cp", 1)
    if cp < 1 or world_size % cp:
        raise ValueError(f"parallel.cp ({cp}) must be >= 1 and divide the number of processes ({world_size})")
    shard = parallel_cfg.dp_shard if parallel_cfg.dp_shard != -1 else world_size // (rep * cp)
    if rep * shard * cp != world_size:
        raise ValueError(
            f"parallel.dp_replicate ({rep}) x parallel.dp_shard ({shard}) x parallel.cp ({cp}) = {rep * shard * cp} "
            f"does not equal the number of processes ({world_size})"
        )
    ep = getattr(parallel_cfg, "ep", 1)
    if ep < 1 or world_size % ep:
        raise ValueError(f"parallel.ep ({ep}) must be >= 1 and divide the number of processes ({world_size})")
    if ep > 1 and cp > 1:
        raise ValueError(f"parallel.ep ({ep}) with parallel.cp ({cp}): expert parallelism with context "
                         "parallelism is not supported; set one of them to 1")
    dims = ParallelDims(rep, shard, world_size, ep, cp=cp)
    if cp == 1:
        mesh = init_device_mesh(device_type, (rep, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(device_type, (rep, shard, cp), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        mesh[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp")
    return dims, mesh


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """("ep_replicate", "ep") = (world / ep, ep) over all ranks: rank r holds expert shard r % ep.
    Collective: every rank must call it."""
    if dims.ep < 1 or dims.world_size % dims.ep:
        raise ValueError(f"parallel.ep ({dims.ep}) must be >= 1 and divide the number of processes ({dims.world_size})")
    return init_device_mesh(device_type, (dims.world_size // dims.ep, dims.ep), mesh_dim_names=("ep_replicate", "ep"))
