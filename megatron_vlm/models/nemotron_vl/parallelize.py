"""Nemotron-H / Nemotron-3-Nano-VL parallel plan: declare the units, call the shared helpers.

Order (DESIGN.md §5): TP -> EP -> CP -> activation checkpointing -> compile -> FSDP. The units are
`model.transformer_blocks()` (RADIO layers, then every hybrid decoder block); embeddings, projector,
final norm and lm_head stay in the root FSDP group.

Expert parallelism (`parallel.ep` > 1): the routed experts of every MoE mixer (`EP_PLAN`: stacked
`[E, out, in]` weights sharded along E) are split over the "ep" mesh dim by the shared `apply_ep`
(tokens exchanged with all-to-all) and kept out of FSDP; the router, shared experts and latent
projections stay FSDP parameters. Tensor and context parallelism are not implemented yet: a config
asking for them fails loudly instead of silently running replicated.
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

# What TP will shard once it exists, and what EP shards (module path patterns inside a decoder block).
TP_PLAN = {
    "mixer.q_proj": "colwise", "mixer.k_proj": "colwise", "mixer.v_proj": "colwise", "mixer.o_proj": "rowwise",
    "mixer.up_proj": "colwise", "mixer.down_proj": "rowwise",
    "mixer.shared_experts.up_proj": "colwise", "mixer.shared_experts.down_proj": "rowwise",
}
EP_PLAN = {"mixer.experts": "shard_experts_dim0"}

parallelize_nemotron_vl = make_parallelize("nemotron_vl", unsupported_dims=("tp", "cp"), note="plan: TP_PLAN")
