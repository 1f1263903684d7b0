"""The device meshes: one world mesh `("pp", "dp_replicate", "dp_shard", "cp", "tp")` (tp innermost,
so a tensor-parallel group is `tp` consecutive ranks, usually one node's fast links) and, with expert
parallelism, ("ep_replicate", "ep") for the routed experts, carved out of the data-parallel ranks.

FSDP2 / HSDP shards over the ("dp_replicate", "dp_shard") sub-mesh; tensor parallelism places its
DTensors on the "tp" sub-mesh of the same world mesh (FSDP2 composes with TP only when both come
from one mesh). Dims of size 1 cost nothing.

Expert-parallel ranks are data-parallel ranks too: every rank reads its own data and holds the
non-expert parameters through FSDP. The routed experts are instead sharded over groups of `ep`
ranks (the "ep" dim) that share the same tp coordinate (ep is carved from dp x cp, as torchtitan
does), and replicated over the data-parallel replicas (the "ep_replicate" dim, whose gradients are
summed); the tp ranks of a group run the MoE blocks on the same tokens, so each tp coordinate has its
own ("ep_replicate", "ep") sub-mesh and the expert gradients are not summed over tp. Expert weights
are excluded from FSDP (see `parallel_plan.make_parallelize`).

Context parallelism adds the innermost dim "cp" (`parallel.cp` consecutive ranks split the tokens of
the same packs): the ranks of a cp group share their data-parallel coordinate, and FSDP shards over
dp_shard x cp flattened ("dp_shard_cp"; parallel/context_parallel.py).
Pipeline parallelism adds the outermost dim "pp" (parallel/pipeline.py): the stages of one pipeline share
their data-parallel coordinate (they read the same micro-batches) and FSDP shards each stage's parameters
over that stage's dp ranks only (pp composes with dp only). tp and cp compose: a cp group is the
ranks with the same tp coordinate (their attention heads match), the cp split encloses the tp
sequence shard inside each decoder layer (`apply_cp`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_vlm.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ConfigError):
    """Parallel sizes that do not fit the processes (a configuration error: the runner exits 2)."""


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    ep: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_rank: int = 0
    """This rank's data-parallel coordinate (dp_replicate x dp_shard): the data shard it reads."""

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def data_copies(self) -> int:
        """Ranks that read the same data shard (the tp and cp ranks of a group, and the pp stages): a sum over
        all ranks of per-data-shard counts counts each shard this many times."""
        return self.tp * self.cp * self.pp


def build_mesh(parallel_cfg, world_size: int, device_type: str) -> tuple[ParallelDims, DeviceMesh]:
    """The world mesh named `MESH_DIMS`; dp_shard -1 takes the ranks left by the other dims."""
    tp = getattr(parallel_cfg, "tp", 1)
    cp = getattr(parallel_cfg, "cp", 1)
    pp = getattr(parallel_cfg, "pp", 1)
    if tp < 1 or world_size % tp:
        raise LayoutError(f"parallel.tp ({tp}) must be >= 1 and divide the number of processes ({world_size})")
    if pp < 1 or world_size % pp:
        raise LayoutError(f"parallel.pp ({pp}) must be >= 1 and divide the number of processes ({world_size})")
    if cp < 1 or world_size % cp:
        raise LayoutError(f"parallel.cp ({cp}) must be >= 1 and divide the number of processes ({world_size})")
    rep = parallel_cfg.dp_replicate
    others = tp * cp * pp
    shard = parallel_cfg.dp_shard if parallel_cfg.dp_shard != -1 else world_size // (rep * others)
    if rep * shard * others != world_size:
        raise LayoutError(
            f"parallel.dp_replicate ({rep}) x parallel.dp_shard ({shard}) x parallel.tp ({tp})"
            + (f" x parallel.cp ({cp})" if cp > 1 else "") + (f" x parallel.pp ({pp})" if pp > 1 else "")
            + f" = {rep * shard * others} does not equal the number of processes ({world_size})"
        )
    ep = getattr(parallel_cfg, "ep", 1)
    if ep < 1 or world_size % ep:
        raise LayoutError(f"parallel.ep ({ep}) must be >= 1 and divide the number of processes ({world_size})")
    if ep > 1 and cp > 1:
        raise LayoutError(f"parallel.ep ({ep}) with parallel.cp ({cp}): expert parallelism with context "
                         "parallelism is not supported; set one of them to 1")
    if (rep * shard * cp) % ep:
        raise LayoutError(f"parallel.ep ({ep}) must divide the data-parallel x context-parallel ranks "
                         f"({rep * shard * cp} = {world_size} processes / parallel.tp {tp})")
    mesh = init_device_mesh(device_type, (pp, rep, shard, cp, tp), mesh_dim_names=MESH_DIMS)
    dp_rank = mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard")
    dims = ParallelDims(rep, shard, world_size, ep, tp=tp, cp=cp, pp=pp, dp_rank=dp_rank)
    if cp > 1:  # FSDP shards over dp_shard x cp (context_parallel.py)
        mesh[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp")
    return dims, mesh


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """This rank's ("ep_replicate", "ep") mesh: an ep group is `ep` ranks with the same tp coordinate and
    consecutive data-parallel x cp coordinates; rank r holds expert shard (its dp x cp index) % ep.
    Collective: every rank must call it."""
    if dims.ep < 1 or dims.world_size % dims.ep:
        raise ValueError(f"parallel.ep ({dims.ep}) must be >= 1 and divide the number of processes ({dims.world_size})")
    tp = dims.tp
    # world ranks are laid out (pp, dp x cp, tp) with tp innermost
    ranks = torch.arange(dims.world_size).view(-1, dims.ep, tp)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("ep_replicate", "ep", "ep_tp"))
    return mesh[("ep_replicate", "ep")]
