"""Text-only Qwen causal LMs: Qwen2 / Qwen2.5 / Qwen2.5-Math (`qwen2`), Qwen3 (`qwen3`), Qwen3-MoE
(`qwen3_moe`), on the decoder of the Qwen2.5-VL / Qwen3-VL families (shared, not copied) with 1-D RoPE.

Import the submodules directly (`args`, `model`, `state_dict_adapter`, `parallelize`: `models.registry`
reads these four): this package file imports none of them, so importing one submodule never
cycles back through the package.
"""
