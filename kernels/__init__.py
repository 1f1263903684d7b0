"""megatron_vlm.kernels: the public functional API of the op library.

Every op here is backed by a pure-torch reference (`kernels/reference/`, the `torch` backend) and,
once registered, by faster backends (Triton, torch_npu, third-party) chosen per op and device by
`kernels/registry.py`. Model code calls only these functions; see each reference module for the
exact layout and numerics contract of an op.
"""
from .reference import attention, apply_rotary, layer_norm, linear_token_logprobs, rms_norm, swiglu

__all__ = ["attention", "rms_norm", "layer_norm", "apply_rotary", "swiglu", "linear_token_logprobs"]
