"""Qwen3-VL (2B / 4B / 8B / 32B) and Qwen3-VL-MoE (30B-A3B / 235B-A22B): ViT with DeepStack + Qwen3
(or Qwen3-MoE) decoder with interleaved M-RoPE. One family serves both `model_type`s.

Import the submodules directly (`args`, `model`, `state_dict_adapter`, `parallelize`: `models.registry`
reads these four): this package file imports none of them, so importing one submodule never
cycles back through the package.
"""
