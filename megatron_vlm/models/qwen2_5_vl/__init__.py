"""Qwen2.5-VL (3B / 7B / 32B / 72B): window-attention ViT + Qwen2 decoder with M-RoPE.

Import the submodules directly (`args`, `model`, `state_dict_adapter`, `parallelize`: `models.registry`
reads these four): this package file imports none of them, so importing one submodule never
cycles back through the package.
"""
