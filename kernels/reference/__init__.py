"""Pure-torch reference implementations of every kernel op.

They are the `torch` backend (always available, used on CPU) and the ground truth of the kernel
tests. Each op lives in its own module; this package only re-exports them.
"""
from .attention import attention
from .norms import layer_norm, rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu
from .token_logprobs import linear_token_logprobs

__all__ = ["attention", "layer_norm", "rms_norm", "apply_rotary", "swiglu", "linear_token_logprobs"]
