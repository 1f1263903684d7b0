"""InternVL (InternVL2.5 / InternVL3 / InternVL3.5 with Qwen2 / Qwen2.5 / Qwen3 LLMs): InternViT + pixel
shuffle + MLP projector + decoder. Reads transformers' (`internvl`) and OpenGVLab's (`internvl_chat`)
checkpoints; exports transformers' layout.

Import the submodules directly (`args`, `model`, `state_dict_adapter`, `parallelize`: `models.registry`
reads these four): this package file imports none of them, so importing one submodule never
cycles back through the package.
"""
