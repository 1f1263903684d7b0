"""Print the software and device facts a benchmark figure must be quoted with (first section of the GPU suite)."""
import importlib
import platform

import torch

print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          f"memory {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
else:
    print("device none (no CUDA)")
for name in ("triton", "transformers", "flash_attn", "transformer_engine", "mamba_ssm", "causal_conv1d", "deep_ep",
             "liger_kernel", "megatron.core"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "installed"))
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        print(name, "absent", type(exc).__name__)
