"""Nemotron-H / Nemotron-3-Nano-VL parallelisation: the shared `make_parallelize` body.

Activation checkpointing covers `model.transformer_blocks()` (RADIO layers, then every hybrid
decoder block); the decoder blocks are the FSDP units; embeddings, projector, final norm and lm_head
stay in the root FSDP group. Expert parallelism (`parallel.ep` > 1): the routed experts of every MoE
mixer (stacked `[E, out, in]` weights, split along E) are sharded over the "ep" mesh dim by the
shared `apply_ep` (tokens exchanged with all-to-all) and kept out of FSDP; the router, shared experts
and latent projections stay FSDP parameters. TP plan (`parallel.tp`, "auto" per block's `mixer`):
attention mixers split by heads, MLP mixers by columns, Mamba2 mixers by heads and B / C groups
(Megatron's layout: `parallel.tp` must divide mamba_num_heads and n_groups), MoE mixers replicated over
the tp ranks (every tp rank runs them on the whole sequence); vocab-parallel embedding (`embeddings`) and
lm_head; the vision side replicated. Context parallelism (`parallel.cp`) splits the attention / MLP / MoE
blocks; the Mamba2 blocks run the whole sequence on every cp rank (their state would have to pass
across chunks).
"""
from __future__ import annotations

from megatron_vlm.models.common.parallel_plan import make_parallelize

parallelize_nemotron_vl = make_parallelize("nemotron_vl", tp_layer_children={"mixer": "auto"},
                                           tp_embedding="language_model.embeddings")
