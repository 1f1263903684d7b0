"""Backends on torch's own fused (private) kernels that beat ours where measured: `torch._grouped_mm`."""
