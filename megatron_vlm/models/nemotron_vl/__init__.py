"""Nemotron-H (hybrid Mamba2 / attention / MoE decoder) and Nemotron-3-Nano-VL (RADIO + projector, or the
Qwen3-VL vision tower with its patch merger and DeepStack: see args.py for the config layouts).

Import the submodules directly (`args`, `model`, `state_dict_adapter`, `parallelize`: `models.registry`
reads these four): this package file imports none of them, so importing one submodule never
cycles back through the package.
"""
