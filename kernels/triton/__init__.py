"""Triton backend: one module per op (`_<op>_fwd_kernel` / `_<op>_bwd_kernel`, launchers, a
torch.library custom op with autograd and fake tensors, and the public-signature function).

Modules are imported lazily by the registry: `triton.jit` decides at decoration time whether a
kernel runs compiled or in the interpreter (TRITON_INTERPRET=1, used on CPU by the tests).
`common.py` holds the small helpers they share.
"""
