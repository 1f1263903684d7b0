"""Nemotron-H / Nemotron-3-Nano-VL parallel plan: declare the units, call the shared helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The units are
`model.transformer_blocks()` (RADIO layers, then every hybrid decoder block); embeddings, projector,
final norm and lm_head stay in the root FSDP group.

Expert parallelism (MoE experts sharded over the `ep` mesh dim, tokens exchanged with all-to-all)
and tensor parallelism are declared here once `megatron_vlm.parallel` provides `apply_ep` /
`apply_tp`; until then a config asking for them fails loudly instead of silently running
replicated. With FSDP the stacked expert weights `[E, out, in]` are sharded along E like any
other parameter, which is what the seed's single-node runs need.
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

# What the TP / EP helpers will shard once they exist (module path patterns inside a decoder block).
TP_PLAN = {
    "mixer.q_proj": "colwise", "mixer.k_proj": "colwise", "mixer.v_proj": "colwise", "mixer.o_proj": "rowwise",
    "mixer.up_proj": "colwise", "mixer.down_proj": "rowwise",
    "mixer.shared_experts.up_proj": "colwise", "mixer.shared_experts.down_proj": "rowwise",
}
EP_PLAN = {"mixer.experts": "shard_experts_dim0"}

parallelize_nemotron_vl = make_parallelize("nemotron_vl", unsupported_dims=("tp", "ep", "cp"), note="plans: TP_PLAN / EP_PLAN")
