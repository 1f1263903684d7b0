"""`csrc` backends of the dense layer ops: fused fp32 CPU kernels compiled into `megatron_vlm._C`.

rms_norm (+ residual), swiglu and decode_attention run as one C++ pass each on the CPU
(csrc/cpu_layer_ops.cpp, csrc/cpu_decode_attention.cpp; layer_ops.py wraps them with autograd). Registered under `auto` for CPU
float32 tensors, where they replace the torch references' chains of elementwise ATen calls.
"""
