"""`ensure_parallel_state`: megatron-core's model-parallel groups set up to match our device meshes.

Called by the dense layer (`layer.py`) and the hybrid block (`hybrid.py`) before building megatron-core modules;
it lives below both."""
from __future__ import annotations

__all__ = ["ensure_parallel_state"]


def ensure_parallel_state(tp_mesh=None, ep_mesh=None) -> None:
    """megatron-core's linears read its model-parallel groups: tensor_model_parallel_size = the size of `tp_mesh`
    (our mesh's "tp" dim; None: 1), expert_model_parallel_size = the size of `ep_mesh`'s "ep" dim (our
    ("ep_replicate", "ep") mesh, `parallel.mesh.build_ep_mesh`; None: 1), pp = 1, over the initialised world.
    megatron-core's default rank order ("tp-cp-ep-dp-pp") makes its tp groups consecutive ranks, as our mesh's are
    (tp innermost), and its ep groups (tp = 1) `ep` consecutive ranks, as our ep mesh's are; its expert tensor
    parallelism is 1 (MoE layers replicated over tp, `moe_layer.moe_layer_spec`); this rank's groups
    are checked against `tp_mesh`'s / `ep_mesh`'s (AssertionError otherwise). With tp > 1 and ep > 1 our ep groups
    (`ep` ranks of one tp coordinate, strided by tp) are not megatron-core's expert groups (consecutive ranks for
    expert tp = 1): its parallel state then gets expert_model_parallel_size = 1, and the MoE layers are given our
    ep group itself (`moe_layer.replicated_over_tp`, as they are with tp = 1). An earlier initialisation with
    other sizes or ranks (a job before this one in the same process) is replaced."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = 1 if tp_mesh is None else tp_mesh.size()
    ep = 1 if ep_mesh is None else ep_mesh.size(ep_mesh.ndim - 1)
    if tp > 1:  # our ep groups are given to the MoE layers directly (docstring)
        ep, ep_mesh = 1, None
    want = None if tp_mesh is None else dist.get_process_group_ranks(tp_mesh.get_group())
    want_ep = None if ep_mesh is None else dist.get_process_group_ranks(ep_mesh.get_group(ep_mesh.ndim - 1))

    def groups():
        return (dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()) if tp > 1 else None,
                dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()) if ep > 1 else None)

    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_expert_model_parallel_world_size() == ep
                and parallel_state.get_expert_tensor_parallel_world_size() == 1 and groups() == (want, want_ep)):
            return
        parallel_state.destroy_model_parallel()
    # expert_tensor_parallel_size = 1: MoE layers are replicated over the tp ranks (moe_layer.moe_layer_spec
    # gives them this size-1 group as their tp group), as the native backend's MoE blocks are
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    have, have_ep = groups()
    if have != want:
        raise AssertionError(f"megatron-core's tensor-parallel group {have} is not our mesh's tp group {want}")
    if have_ep != want_ep:
        raise AssertionError(f"megatron-core's expert-parallel group {have_ep} is not our mesh's ep group {want_ep}")
