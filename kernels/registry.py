"""Backend choice per op: configuration + tensor device + availability, with one log line per choice.

An op (e.g. "attention") has several backends, each registered with `register_backend`:
`torch` (the reference, always usable), `triton` (ours; CUDA, or CPU under TRITON_INTERPRET=1),
`npu` (torch_npu adapters) and third-party ones such as `flash_attn`. Implementations are named by
an import path ("package.module:function") and imported only when first chosen — Triton decides
at decoration time whether a kernel is interpreted, so importing kernel modules eagerly would
freeze that choice before tests can set TRITON_INTERPRET.

`configure({"attention": "triton", ...})` forces a backend per op ("auto" = let the registry
choose). `auto` takes, among the backends usable for the tensor (device and dtype), the one with
the highest priority whose `auto_devices` contains the tensor's device type; the torch reference
is the fallback everywhere. Forcing a backend that cannot run raises `BackendUnavailableError`
naming the op, the backend and why. Ops can be registered from any module (one call per
backend), so new ops (MoE, Mamba) plug in without touching this file's logic.

The registry is an object (`KernelRegistry`); the package uses one default instance.
"""
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

logger = logging.getLogger("megatron_vlm.kernels")

AUTO = "auto"
# Availability check: gets the device type and dtype of the op's first tensor argument, returns
# None when the backend can run it, or the reason it cannot.
Check = Callable[[str, torch.dtype], Optional[str]]


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run this call (not installed, wrong device, unsupported dtype ...)."""


class _Slot:
    """Holds a backend's implementation once imported (an attribute read late, so that dynamo,
    tracing `resolve`, sees the function loaded by `_traced_choice` during the same trace)."""

    fn: Optional[Callable] = None


@dataclass(frozen=True)
class Backend:
    """One implementation of an op."""

    name: str
    target: str  # "package.module:function", imported lazily
    check: Check
    auto_devices: Tuple[str, ...] = ()  # device types on which `auto` may pick it
    priority: int = 0  # higher wins in `auto`
    slot: _Slot = field(default_factory=_Slot, compare=False, repr=False)


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return name in sys.modules


def always(device_type: str, dtype: torch.dtype) -> Optional[str]:
    return None


def triton_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """Triton kernels run on CUDA, or on CPU through the interpreter (TRITON_INTERPRET=1 before import)."""
    if not _module_installed("triton"):
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
            return "tensor on cpu and TRITON_INTERPRET is not set"
        return None
    return f"tensor on {device_type}; triton needs cuda (or cpu with TRITON_INTERPRET=1)"


def npu_check(device_type: str, dtype: torch.dtype) -> Optional[str]:
    if not _module_installed("torch_npu"):
        return "torch_npu is not installed"
    if device_type != "npu":
        return f"tensor on {device_type}; the npu backend needs an npu tensor"
    return None


def cuda_package_check(package: str, dtypes: Tuple[torch.dtype, ...] = ()) -> Check:
    """Check for a third-party CUDA package (flash_attn, liger_kernel ...), optionally limited to dtypes."""

    def check(device_type: str, dtype: torch.dtype) -> Optional[str]:
        if not _module_installed(package):
            return f"{package} is not installed"
        if device_type != "cuda":
            return f"tensor on {device_type}; {package} needs a cuda tensor"
        if dtypes and dtype not in dtypes:
            return f"{package} does not support {dtype} (needs one of {', '.join(str(d) for d in dtypes)})"
        return None

    return check


@dataclass
class KernelRegistry:
    """Ops -> backends, the forced choice per op, and the log-once bookkeeping."""

    backends: Dict[str, Dict[str, Backend]] = field(default_factory=dict)
    forced: Dict[str, str] = field(default_factory=dict)
    _logged: set = field(default_factory=set)

    def register(self, op: str, backend: Backend) -> None:
        self.backends.setdefault(op, {})[backend.name] = backend

    def ops(self) -> Tuple[str, ...]:
        return tuple(self.backends)

    def configure(self, choices: Mapping[str, str]) -> Dict[str, str]:
        """Force a backend ("auto" = choose) per op; returns the previous choices (to restore)."""
        if hasattr(choices, "as_dict"):
            choices = choices.as_dict()
        for op, name in choices.items():
            if op not in self.backends:
                raise KeyError(f"kernels: unknown op {op!r}; known ops: {', '.join(sorted(self.backends))}")
            if name != AUTO and name not in self.backends[op]:
                raise KeyError(
                    f"kernels: unknown backend {name!r} for op {op!r}; "
                    f"known: {AUTO}, {', '.join(sorted(self.backends[op]))}"
                )
        previous = dict(self.forced)
        for op, name in choices.items():
            if name == AUTO:
                self.forced.pop(op, None)
            else:
                self.forced[op] = name
        return previous

    def restore(self, previous: Mapping[str, str]) -> None:
        self.forced = dict(previous)

    def availability(self, op: str, x: torch.Tensor) -> Dict[str, Optional[str]]:
        """Backend name -> None (usable for x) or the reason it is not."""
        return {name: b.check(x.device.type, x.dtype) for name, b in self._backends_of(op).items()}

    def _backends_of(self, op: str) -> Dict[str, Backend]:
        if op not in self.backends:
            raise KeyError(f"kernels: unknown op {op!r}; known ops: {', '.join(sorted(self.backends))}")
        return self.backends[op]

    @staticmethod
    def _load(backend: Backend) -> Callable:
        if backend.slot.fn is None:
            module, _, attr = backend.target.partition(":")
            backend.slot.fn = getattr(importlib.import_module(module), attr)
        return backend.slot.fn

    def choose(self, op: str, device_type: str, dtype: torch.dtype) -> str:
        """The backend name that will run `op` for a call whose first tensor has this device type / dtype."""
        backends = self._backends_of(op)
        forced = self.forced.get(op)
        if forced is not None:
            reason = backends[forced].check(device_type, dtype)
            if reason is not None:
                raise BackendUnavailableError(f"kernels: op {op!r} is configured to backend {forced!r}, which cannot run: {reason}")
            return forced
        candidates = [b for b in backends.values() if device_type in b.auto_devices and b.check(device_type, dtype) is None]
        name = max(candidates, key=lambda b: b.priority).name if candidates else "torch"
        if name not in backends:
            raise BackendUnavailableError(f"kernels: op {op!r} has no usable backend for a {device_type} {dtype} tensor")
        key = (op, device_type, name)
        if key not in self._logged:
            self._logged.add(key)
            logger.info("kernels: %s on %s uses backend %s (auto)", op, device_type, name)
        return name

    def resolve(self, op: str, x: torch.Tensor) -> Callable:
        """The implementation to call for `op` given its first tensor argument.

        Under torch.compile the choice of the default registry is made once at trace time
        (`_traced_choice`, a constant for dynamo: configure() before compiling), so model code
        compiles with fullgraph=True through the dispatcher.
        """
        if torch.compiler.is_compiling() and self is DEFAULT_REGISTRY:
            return self.backends[op][_traced_choice(op, x.device.type, x.dtype)].slot.fn
        name = self.choose(op, x.device.type, x.dtype)
        return self._load(self.backends[op][name])


DEFAULT_REGISTRY = KernelRegistry()


@torch.compiler.assume_constant_result
def _traced_choice(op: str, device_type: str, dtype: torch.dtype) -> str:
    """The default registry's backend name for op, chosen (and imported) eagerly while dynamo
    traces; a constant of the graph, so configure() before compiling."""
    name = DEFAULT_REGISTRY.choose(op, device_type, dtype)
    DEFAULT_REGISTRY._load(DEFAULT_REGISTRY.backends[op][name])
    return name


def register_backend(
    op: str,
    name: str,
    target: str,
    *,
    check: Check = always,
    auto_devices: Tuple[str, ...] = (),
    priority: int = 0,
    registry: Optional[KernelRegistry] = None,
) -> None:
    """Register `target` ("module:function") as backend `name` of `op` (in the default registry)."""
    (registry or DEFAULT_REGISTRY).register(op, Backend(name, target, check, tuple(auto_devices), priority))


def configure(choices: Mapping[str, str]) -> Dict[str, str]:
    """Apply a `[kernels]` section (dict op -> backend or "auto", or a KernelsConfig); returns the previous one."""
    return DEFAULT_REGISTRY.configure(choices)


def resolve(op: str, x: torch.Tensor) -> Callable:
    return DEFAULT_REGISTRY.resolve(op, x)


# Built-in ops: (op, module name under reference/ triton/ npu/, function). The torch reference is
# always there and is the fallback; under `auto` a third-party backend (priority 20) beats our
# Triton kernels (10) on CUDA, and the torch_npu adapters (10) are taken on NPU.
_PKG = __name__.rpartition(".")[0]
_BUILTIN_OPS = (
    ("attention", "attention", "attention"),
    ("rms_norm", "norms", "rms_norm"),
    ("layer_norm", "norms", "layer_norm"),
    ("apply_rotary", "rotary", "apply_rotary"),
    ("swiglu", "swiglu", "swiglu"),
    ("linear_token_logprobs", "token_logprobs", "linear_token_logprobs"),
)
_TRITON_MODULES = {"rms_norm": "rms_norm", "layer_norm": "layer_norm"}  # triton/ splits the two norms
_NPU_OPS = {"attention": "attention", "rms_norm": "rms_norm", "apply_rotary": "rotary", "swiglu": "swiglu"}
for _op, _module, _fn in _BUILTIN_OPS:
    register_backend(_op, "torch", f"{_PKG}.reference.{_module}:{_fn}", auto_devices=("cpu", "cuda", "npu"))
    register_backend(
        _op, "triton", f"{_PKG}.triton.{_TRITON_MODULES.get(_op, _module)}:{_fn}",
        check=triton_check, auto_devices=("cuda",), priority=10,
    )
    if _op in _NPU_OPS:
        register_backend(_op, "npu", f"{_PKG}.npu.{_NPU_OPS[_op]}:{_fn}", check=npu_check, auto_devices=("npu",), priority=10)
register_backend(
    "attention", "flash_attn", f"{_PKG}.thirdparty.flash_attn:attention",
    check=cuda_package_check("flash_attn", (torch.float16, torch.bfloat16)), auto_devices=("cuda",), priority=20,
)

# Mamba2 and MoE ops (Nemotron-H, Qwen3-VL-MoE): torch reference everywhere, torch_npu adapters for MoE.
for _op, _module in (
    ("causal_conv1d", "causal_conv1d"),
    ("ssd_chunk_scan", "ssd"),
    ("ssd_state_update", "ssd"),
    ("moe_permute", "moe"),
    ("grouped_mm", "moe"),
    ("moe_unpermute", "moe"),
):
    register_backend(_op, "torch", f"{_PKG}.reference.{_module}:{_op}", auto_devices=("cpu", "cuda", "npu"), priority=0)
for _op in ("moe_permute", "grouped_mm", "moe_unpermute"):
    register_backend(_op, "npu", f"{_PKG}.npu.moe:{_op}", check=npu_check, auto_devices=("npu",), priority=10)
# Triton MoE kernels (kernels/triton/moe.py); moe_permute stays on the reference.
for _op in ("grouped_mm", "moe_unpermute"):
    register_backend(_op, "triton", f"{_PKG}.triton.moe:{_op}", check=triton_check, auto_devices=("cuda",), priority=10)
