"""Megatron-core interop for the language decoders: HF <-> megatron-core state dicts and the
TransformerConfig that builds the matching megatron-core GPT model (`convert.py`, `config.py`), and the
`parallel.backend = "mcore"` decoder layers (`layer.py`; megatron-core's MoELayer for MoE blocks in
`moe_layer.py`, the Nemotron-H hybrid's Mamba / attention / MLP / MoE layers in `hybrid.py`) and their
tensor-parallel weight blocks (`tp_shard.py`).

megatron-core is optional (`pip install -e ".[mcore]"`); nothing here imports it at module level.
"""
from .convert import hf_to_mcore, mcore_to_hf

__all__ = ["hf_to_mcore", "mcore_to_hf"]
