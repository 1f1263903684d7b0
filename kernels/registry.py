"""Backend choice per op: process default + scoped overrides + tensor device/dtype + availability.

An op (e.g. "attention") has several backends, each registered with `register_backend`:
`torch` (the reference, always usable), `triton` (ours; CUDA, or CPU under TRITON_INTERPRET=1),
`npu` (torch_npu adapters) and third-party ones such as `flash_attn` (the built-in table is in
`builtin_ops.py`, the availability checks in `availability.py`). Implementations are named by an import path ("package.module:function") and
imported only when first chosen — Triton decides at decoration time whether a kernel is
interpreted, so importing kernel modules eagerly would freeze that choice before tests can set
TRITON_INTERPRET.

Which backend an op uses ("auto" = let the registry choose):
- `configure({"attention": "triton", ...})` sets the process default (the job applies its
  `[kernels]` TOML section once);
- `with use_backends({"attention": "torch"}):` overrides it for the code inside the block only
  (a `contextvars` scope: nests, restores on exit, each thread and asyncio task sees its own), so a
  policy and a reference model in one process can run the same op on different backends. A new
  thread starts without the scope (as with any contextvar); so does a forward recomputed by
  activation checkpointing inside the autograd engine's worker threads, which therefore uses the
  process default: scope models that recompute only where the default is what they need.
`auto` takes, among the backends usable for the tensor (device and dtype), the one with the
highest priority whose `auto_devices` contains the tensor's device type, logged once; the torch
reference is the fallback everywhere. Forcing a backend that cannot run raises
`BackendUnavailableError` naming the op, the backend and why.

Decisions are cached per (op, device type, dtype, configured choice), and each availability check
runs once per (op, backend, device type, dtype): an eager call costs a few dict lookups, not an
import probe. `clear_cache()` forgets them (after changing the environment a check reads);
registering a backend clears them too.
"""
import contextlib
import contextvars
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

import torch

from megatron_vlm.errors import ConfigError

if TYPE_CHECKING:  # the checks themselves live in availability.py; this module imports no sibling
    from .availability import Check
    from .config import KernelsConfig

logger = logging.getLogger("megatron_vlm.kernels")

_DYNAMO_CONSTANT = "_dynamo_marked_constant"
"""The attribute `torch.compiler.assume_constant_result` sets on a function: dynamo reads it while tracing."""


def assume_constant_result(fn: Callable) -> Callable:
    """`torch.compiler.assume_constant_result(fn)` without importing torch._dynamo when it is not imported yet.

    Why: torch's decorator imports torch._dynamo (~1.7 s) for a mark it sets on the function, and the kernel
    modules apply it at import (with the config package), so every config refusal paid dynamo's import for nothing.
    Dynamo reads the mark only while it traces, by which time torch.compile has imported it; with dynamo already
    imported this is torch's own decorator (tests/unit/kernels/test_dynamo_import_deferred.py checks that the
    two mark a function alike)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    return _marked_constant(fn)


def _marked_constant(fn: Callable) -> Callable:
    """fn with the mark torch's decorator sets, set here (dynamo not imported)."""
    setattr(fn, _DYNAMO_CONSTANT, True)
    return fn

AUTO = "auto"
_NO_SCOPE: Mapping[str, str] = MappingProxyType({})


class BackendUnavailableError(ConfigError, RuntimeError):
    """A forced backend cannot run this call (not installed, wrong device, unsupported dtype ...).

    A `ConfigError` (the `[kernels]` key asks for what this run cannot do: the runner exits 2) and still a
    `RuntimeError`, as callers that predate that catch it."""


class _Slot:
    """Holds a backend's implementation once imported (an attribute read late, so that dynamo,
    tracing `resolve`, sees the function loaded by `_traced_choice` during the same trace)."""

    fn: Optional[Callable] = None


@dataclass(frozen=True)
class Backend:
    """One implementation of an op."""

    name: str
    target: str  # "package.module:function", imported lazily
    check: Optional["Check"] = None  # None: usable for every device and dtype
    auto_devices: tuple[str, ...] = ()  # device types on which `auto` may pick it
    priority: int = 0  # higher wins in `auto`
    slot: _Slot = field(default_factory=_Slot, compare=False, repr=False)


@dataclass(frozen=True)
class _Decision:
    """A cached choice: the backend name, or why the configured backend cannot run."""

    name: Optional[str]
    error: Optional[str] = None


class KernelRegistry:
    """Ops -> backends, the process-default choice per op, scoped overrides, and the caches."""

    def __init__(self) -> None:
        self.backends: dict[str, dict[str, Backend]] = {}
        self.forced: dict[str, str] = {}  # process default; ops absent are "auto"
        self._scope: contextvars.ContextVar = contextvars.ContextVar("megatron_vlm_kernels_scope", default=_NO_SCOPE)
        self._logged: set = set()
        self._probes: dict[tuple, Optional[str]] = {}
        self._decisions: dict[tuple, _Decision] = {}
        self._lock = threading.Lock()

    # -- registration and configuration ------------------------------------------------------
    def register(self, op: str, backend: Backend) -> None:
        with self._lock:
            self.backends.setdefault(op, {})[backend.name] = backend
            self._clear_locked()

    def ops(self) -> tuple[str, ...]:
        return tuple(self.backends)

    def validated(self, choices: "Mapping[str, str] | KernelsConfig") -> dict[str, str]:
        """choices (a dict op -> backend or "auto", or a KernelsConfig) as a dict, checked against the
        registered ops and backends (KeyError naming the unknown op / backend)."""
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
        return dict(choices)

    def configure(self, choices: "Mapping[str, str] | KernelsConfig") -> dict[str, str]:
        """Set the process default ("auto" = choose) per op; returns the previous default (to restore)."""
        choices = self.validated(choices)
        previous = dict(self.forced)
        for op, name in choices.items():
            if name == AUTO:
                self.forced.pop(op, None)
            else:
                self.forced[op] = name
        return previous

    def restore(self, previous: Mapping[str, str]) -> None:
        self.forced = dict(previous)

    @contextlib.contextmanager
    def use_backends(self, choices: Mapping[str, str]) -> Iterator[None]:
        """Within the block, `choices` (op -> backend, or "auto" to let the registry choose even where
        an outer scope or the default forces one) override the outer scope and the process default
        for the current thread / asyncio task; the previous state comes back on exit."""
        merged = {**self._scope.get(), **self.validated(choices)}
        token = self._scope.set(MappingProxyType(merged))
        try:
            yield
        finally:
            self._scope.reset(token)

    def choice(self, op: str) -> str:
        """The configured backend of op here: the innermost scope's, else the process default's, else "auto"."""
        scoped = self._scope.get()
        if op in scoped:
            return scoped[op]
        return self.forced.get(op, AUTO)

    def choices(self) -> dict[str, str]:
        """op -> configured backend or "auto", as `choice` sees it in the current context."""
        return {op: self.choice(op) for op in self.backends}

    # -- availability and choice (cached) ----------------------------------------------------
    def clear_cache(self) -> None:
        """Forget cached availability checks and decisions (e.g. after changing TRITON_INTERPRET)."""
        with self._lock:
            self._clear_locked()

    def _clear_locked(self) -> None:
        self._probes.clear()
        self._decisions.clear()

    def _backends_of(self, op: str) -> dict[str, Backend]:
        if op not in self.backends:
            raise KeyError(f"kernels: unknown op {op!r}; known ops: {', '.join(sorted(self.backends))}")
        return self.backends[op]

    def _probe(self, op: str, backend: Backend, device_type: str, dtype: torch.dtype) -> Optional[str]:
        key = (op, backend.name, device_type, dtype)
        if key not in self._probes:
            self._probes[key] = None if backend.check is None else backend.check(device_type, dtype)
        return self._probes[key]

    def availability(self, op: str, x: torch.Tensor) -> dict[str, Optional[str]]:
        """Backend name -> None (usable for x) or the reason it is not."""
        backends = self._backends_of(op)
        with self._lock:
            return {name: self._probe(op, b, x.device.type, x.dtype) for name, b in backends.items()}

    def _decide(self, op: str, device_type: str, dtype: torch.dtype, configured: str) -> _Decision:
        backends = self._backends_of(op)
        if configured != AUTO:
            reason = self._probe(op, backends[configured], device_type, dtype)
            if reason is not None:
                return _Decision(None, f"kernels: op {op!r} is configured to backend {configured!r}, which cannot run: {reason}")
            return _Decision(configured)
        candidates = [
            b for b in backends.values()
            if device_type in b.auto_devices and self._probe(op, b, device_type, dtype) is None
        ]
        name = max(candidates, key=lambda b: b.priority).name if candidates else "torch"
        if name not in backends:
            return _Decision(None, f"kernels: op {op!r} has no usable backend for a {device_type} {dtype} tensor")
        if (op, device_type, name) not in self._logged:
            self._logged.add((op, device_type, name))
            logger.info("kernels: %s on %s uses backend %s (auto)", op, device_type, name)
        return _Decision(name)

    def choose(self, op: str, device_type: str, dtype: torch.dtype) -> str:
        """The backend name that will run `op` for a call whose first tensor has this device type / dtype."""
        key = (op, device_type, dtype, self.choice(op))
        decision = self._decisions.get(key)
        if decision is None:
            with self._lock:
                decision = self._decisions.get(key)
                if decision is None:
                    decision = self._decisions[key] = self._decide(op, *key[1:])
        if decision.error is not None:
            raise BackendUnavailableError(decision.error)
        return decision.name

    @staticmethod
    def _load(backend: Backend) -> Callable:
        if backend.slot.fn is None:
            module, _, attr = backend.target.partition(":")
            backend.slot.fn = getattr(importlib.import_module(module), attr)
        return backend.slot.fn

    def implementation(self, op: str, name: str) -> Callable:
        """Backend `name` of `op` itself, whatever the configuration chooses: how a backend reaches another one
        (DeepEP's adapter falls back to the `torch` all-to-all) without importing the package that defines it."""
        backends = self._backends_of(op)
        if name not in backends:
            raise KeyError(f"kernels: op {op!r} has no backend {name!r}; known: {', '.join(sorted(backends))}")
        return self._load(backends[name])

    def resolve(self, op: str, x: torch.Tensor) -> Callable:
        """The implementation to call for `op` given its first tensor argument.

        Under torch.compile the choice of the default registry is made once at trace time
        (`_traced_choice`, a constant for dynamo), so model code compiles with fullgraph=True
        through the dispatcher; the compiled graph keeps the backend of the scope and default that
        were active while tracing (configure / enter the scope before compiling).
        """
        if torch.compiler.is_compiling() and self is DEFAULT_REGISTRY:
            return self.backends[op][_traced_choice(op, x.device.type, x.dtype)].slot.fn
        return self._load(self.backends[op][self.choose(op, x.device.type, x.dtype)])


DEFAULT_REGISTRY = KernelRegistry()


@assume_constant_result
def _traced_choice(op: str, device_type: str, dtype: torch.dtype) -> str:
    """The default registry's backend name for op, chosen (and imported) eagerly while dynamo
    traces; a constant of the graph."""
    name = DEFAULT_REGISTRY.choose(op, device_type, dtype)
    DEFAULT_REGISTRY._load(DEFAULT_REGISTRY.backends[op][name])
    return name


def register_backend(
    op: str,
    name: str,
    target: str,
    *,
    check: Optional["Check"] = None,
    auto_devices: tuple[str, ...] = (),
    priority: int = 0,
    registry: Optional[KernelRegistry] = None,
) -> None:
    """Register `target` ("module:function") as backend `name` of `op` (in the default registry)."""
    (registry or DEFAULT_REGISTRY).register(op, Backend(name, target, check, tuple(auto_devices), priority))


def configure(choices: "Mapping[str, str] | KernelsConfig") -> dict[str, str]:
    """Apply a `[kernels]` section (dict op -> backend or "auto", or a KernelsConfig) as the process
    default; returns the previous default."""
    return DEFAULT_REGISTRY.configure(choices)


def use_backends(choices: Mapping[str, str]) -> "contextlib.AbstractContextManager[None]":
    """Context manager (also a decorator): `choices` override the default registry's choice inside
    the block, for this thread / asyncio task only; e.g. a reference model's forward under
    `use_backends({"attention": "torch"})` while the policy keeps the configured default."""
    return DEFAULT_REGISTRY.use_backends(choices)


def resolve(op: str, x: torch.Tensor) -> Callable:
    return DEFAULT_REGISTRY.resolve(op, x)
