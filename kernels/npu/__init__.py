"""torch_npu backend: one adapter module per op mapping our API onto Ascend fused ops.

torch_npu is imported inside the adapters only (it is absent on CPU / CUDA machines); the tests
check the adapters against `tests/unit/kernels/npu_emulator.py`, a pure-torch emulation of the
documented torch_npu semantics, installed as a fake `torch_npu` module.
"""
