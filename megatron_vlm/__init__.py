"""megatron-vlm: Megatron-style training of vision-language models (SFT and GRPO)."""
from megatron_vlm.kernels_name import bind_installed_kernels as _bind_installed_kernels

__version__ = "0.1.0"

_bind_installed_kernels()  # the checkout's kernels/ folder must not stand in for an installed `kernels` package
