"""Text-only Qwen parallelisation: the shared `make_parallelize` body, as for the VLM families.

Activation checkpointing and the FSDP units are the decoder layers (`model.transformer_blocks()`,
no vision blocks); embeddings, final norm and lm_head stay in the root unit (tied embeddings stay in
one group). Qwen3-MoE: with `parallel.ep` > 1 the routed experts are sharded over the "ep" mesh dim
and kept out of FSDP. Context parallelism (`parallel.cp`) is the
shared one; tensor parallelism is not implemented yet and fails loudly.
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_qwen_text = make_parallelize("qwen_text", unsupported_dims=("tp",))
