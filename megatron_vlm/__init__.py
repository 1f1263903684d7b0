"""megatron-vlm: Megatron-style training of vision-language models (SFT and GRPO)."""
__version__ = "0.1.0"
