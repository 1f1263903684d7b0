"""Suite-wide test settings.

Without a CUDA device, Triton kernels can only run in the Triton interpreter, and `triton.jit`
decides interpreter vs compiled at decoration time — so TRITON_INTERPRET must be set before any
test module (in any folder) imports a `megatron_vlm.kernels.triton.*` module. This root conftest
is imported before every test module.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
