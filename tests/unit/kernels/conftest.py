"""Kernel tests run the Triton kernels in the Triton interpreter on CPU.

`triton.jit` picks the interpreter at decoration time (triton/runtime/jit.py reads
`knobs.runtime.interpret`, i.e. TRITON_INTERPRET, when the decorator runs), so the variable must be
set before any `megatron_vlm.kernels.triton.*` module is imported; conftest files are imported
before the test modules of their folder. `test_triton_interpreted_at_decoration` checks that it
took effect. Helper modules of this folder (kernel_checks, npu_emulator) are imported by name.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"
