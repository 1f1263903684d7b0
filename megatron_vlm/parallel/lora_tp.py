"""Tensor parallelism of LoRA-adapted linear layers (`LoRALinear`, models/common/lora.py): where the two
factors live when the base layer is column- or row-parallel.

Why a style of its own: torch's `ColwiseParallel` / `RowwiseParallel` place every parameter of the module
they are given the same way and re-register it under its `named_parameters()` name, which for a
`LoRALinear` includes the nested `lora_A.weight` / `lora_B.weight` (a KeyError: parameter names cannot
contain "."), and one placement for all of them would be wrong anyway. Megatron's layout of LoRA under TP
(NeMo's too) keeps the adapter's extra communication at zero:

* column-parallel base (weight `Shard(0)`, output split over the tp ranks): `lora_A` [r, in] `Replicate`
  (every rank reads the whole input), `lora_B` [out, r] `Shard(0)` like the base weight, so B(A x) comes
  out split on the same output columns as x W^T and adds to it locally;
* row-parallel base (weight `Shard(1)`, input split, output a `Partial` sum): `lora_A` `Shard(1)` like the
  base weight (each rank reads its input columns), `lora_B` `Replicate`; A_local x_local is a partial sum
  of A x, B is linear, so B(A_local x_local) is a partial sum of B A x and joins the base's `Partial`
  output before the reduction that follows (the sequence-parallel region's reduce-scatter).

`LoRALinear.forward` then runs unchanged on DTensors: DTensor's sharding propagation picks exactly these
local matmuls (no redistribution). A `Replicate` factor's gradient comes out `Partial` (each rank holds
the contribution of its output columns / input columns); FSDP2 all-reduces it over tp when it
redistributes the gradient to the parameter's placement, as for the per-head QK-norm weights
(`tensor_parallel._partial_grad_params`), so every tp rank applies the same update to its replica.

Adapter dropout acts on the DTensor input. With DTensor's random-number tracker (CUDA-like devices) a
`Replicate` input gets one mask on all tp ranks and a `Shard` input the slice of one global mask. On CPU
DTensor has no tracker and each rank draws from its own generator: the run seeds every rank alike
(`seed_everything`), so a column-parallel layer's replicated input still gets one mask on all tp ranks
(the same as at tp = 1), while the row-parallel layer's input halves get the same mask pattern each
(a valid dropout, elementwise Bernoulli, but not the tp = 1 draw).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["LoRAColwiseParallel", "LoRARowwiseParallel", "is_lora_linear"]


def is_lora_linear(module) -> bool:
    """A `LoRALinear` (models/common/lora.py), told by its structure: the parallel package does not import
    the models package (tests/unit/test_import_graph.py), which imports it."""
    return isinstance(module, nn.Linear) and isinstance(getattr(module, "lora_A", None), nn.Linear) \
        and isinstance(getattr(module, "lora_B", None), nn.Linear)


def _place(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank) -> None:
    p = getattr(module, name, None)
    if p is None or isinstance(p, DTensor):
        return
    module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [placement], src_data_rank=src_data_rank),
                                                 requires_grad=p.requires_grad))


def _check_lora(module: nn.Module, style: str) -> None:
    if not is_lora_linear(module):
        raise TypeError(f"{style}: expected a LoRALinear, got {type(module).__name__}")


class LoRAColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a `LoRALinear`: weight / bias and `lora_B` `Shard(0)`, `lora_A` `Replicate`."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # lora_A / lora_B / dropout: placed with their owner (the root call) below
            return
        _check_lora(module, type(self).__name__)
        src = self.src_data_rank
        _place(module, "weight", device_mesh, Shard(0), src)
        _place(module, "bias", device_mesh, Shard(0), src)
        _place(module.lora_A, "weight", device_mesh, Replicate(), src)
        _place(module.lora_B, "weight", device_mesh, Shard(0), src)


class LoRARowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` for a `LoRALinear`: weight and `lora_A` `Shard(1)`, bias and `lora_B` `Replicate`."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:
            return
        _check_lora(module, type(self).__name__)
        src = self.src_data_rank
        _place(module, "weight", device_mesh, Shard(1), src)
        _place(module, "bias", device_mesh, Replicate(), src)
        _place(module.lora_A, "weight", device_mesh, Shard(1), src)
        _place(module.lora_B, "weight", device_mesh, Replicate(), src)
