"""Blocks shared by the model families: attention, MLP, norms, rotary / M-RoPE, vision blocks,
vision-feature merging and the KV cache. Import the submodules directly."""
