"""Qwen3-VL parallelisation: the shared `make_parallelize` body.

Of TP -> EP -> CP -> activation checkpointing -> compile -> FSDP, the shared helpers provide EP, AC,
compile and FSDP2. MoE variants: with `parallel.ep` > 1 the routed
experts are sharded over the "ep" mesh dim (`apply_ep`, all-to-all token dispatch) and kept out of
FSDP; with ep = 1 they are sharded by FSDP like any other parameter. TP plan (`parallel.tp`): each
decoder layer's `self_attn` split by heads (per-head QK-norm weights whole on every rank), a dense `mlp`
by columns ("auto"), a MoE `mlp` replicated over the tp ranks; vocab-parallel embedding and lm_head; the
vision tower replicated. Context parallelism (`parallel.cp`) is the shared one (parallel/context_parallel.py).
Activation checkpointing covers `model.transformer_blocks()` (vision blocks and decoder layers); the
FSDP units are the decoder layers only: the vision tower (with its DeepStack mergers), embeddings,
final norm and lm_head stay in the root unit, so a rank whose micro-batch has no image still
reduces the same parameters as the others (and tied embeddings stay in one group).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen3_vl = make_parallelize("qwen3_vl", tp_layer_children={"self_attn": "attention", "mlp": "auto"})
