"""megatron_vlm.kernels: public functional API of the op library (placeholder until the kernel issue lands)."""
