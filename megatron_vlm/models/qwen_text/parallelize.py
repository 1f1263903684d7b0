"""Text-only Qwen parallelisation: the shared `make_parallelize` body, as for the VLM families.

Activation checkpointing and the FSDP units are the decoder layers (`model.transformer_blocks()`,
no vision blocks); embeddings, final norm and lm_head stay in the root unit (tied embeddings stay in
one group). Qwen3-MoE: with `parallel.ep` > 1 the routed experts are sharded over the "ep" mesh dim
and kept out of FSDP. TP plan (`parallel.tp`): attention split by heads, dense MLPs by columns, MoE
blocks replicated over the tp ranks, vocab-parallel embedding and lm_head. Context parallelism
(`parallel.cp`) is the shared one (parallel/context_parallel.py).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen_text = make_parallelize("qwen_text", tp_layer_children={"self_attn": "attention", "mlp": "auto"})
