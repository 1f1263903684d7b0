"""`AdamWBf16Moments`: AdamW whose two moments are stored in bf16 (`optimizer.moments_dtype = "bf16"`).

Why: the moments in fp32 take 8 bytes per trainable parameter, in bf16 4. On one GPU at the
Qwen2.5-VL-3B shape that frees 14 GiB, room for a 16k-token step's activations under selective
checkpointing on an 80 GB card without recomputing whole blocks. The master weights and gradients
stay as they are (fp32); the moments are computed in fp32 each step and rounded stochastically to
bf16, so that b2 = 0.999's 0.1 % changes, under half a bf16 ulp, are not rounded away
(`kernels/reference/adamw.py` says why, and is the update's contract).

The update is torch.optim.AdamW's (decoupled weight decay, bias correction); the kernel is
`megatron_vlm.kernels.adamw_bf16_moments` (our fused Triton pass on CUDA, torch ops elsewhere), run on
the local tensors of DTensor parameters (FSDP2 shards: the update is elementwise), without DTensor's
per-op dispatch. The state keeps torch's names (`step`, `exp_avg`, `exp_avg_sq`), so distributed
checkpoints save and reshard it as they do AdamW's; `load_state_dict` keeps the moments in bf16 (torch's
casts every floating state to the parameter's dtype) and converts fp32 ones. The rounding is seeded by (seed, step,
the parameter's name): a resumed run rounds as the uninterrupted one would, and two copies of one weight that take
the same gradients round alike, and so stay equal, wherever they sit in their optimizer's lists: a tied embedding /
lm_head held by the first and the last pipeline stage (parallel/pipeline.py; the last stage names it by the
embedding's name), a data-parallel replica. A parameter given without a name is keyed by its group and position.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any, Optional

import torch

from megatron_vlm import kernels
from megatron_vlm.training.adamw_local import local_pieces

__all__ = ["AdamWBf16Moments", "MOMENT_KEYS"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _name_key(name: str) -> int:
    """A parameter's rounding key from its name: the same in every process (unlike `hash`)."""
    return zlib.crc32(name.encode())




class AdamWBf16Moments(torch.optim.Optimizer):
    """AdamW (torch's update) with bf16, stochastically rounded moments; `seed` seeds the rounding, `names` (parameter
    -> its name in the model) keys each parameter's random bits (module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, seed: int = 0,
                 names: Optional[Mapping[Any, str]] = None):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamWBf16Moments: invalid lr {lr}, eps {eps}, weight_decay {weight_decay} or betas {betas}")
        # torch.optim.AdamW's group keys too (the flags at what this optimizer does), so that a checkpoint of either
        # loads into the other: a run resumed with another optimizer.moments_dtype converts the moments
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                                      maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                                      decoupled_weight_decay=True))
        self.seed = int(seed)
        self._keys: dict[int, int] = {id(p): _name_key(name) for p, name in (names or {}).items()}
        self._names: dict[int, str] = {id(p): name for p, name in (names or {}).items()}
        """id(parameter) -> its rounding key (module docstring): from its name, else from (group, position)."""
        self._steps: dict[int, int] = {}
        """id(parameter) -> its state's step count, mirrored on the host as a Python int: reading the `step` tensor
        (a host tensor) each step would look like a device read to the host-read counter (testing/host_reads.py)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with the moments kept in bf16 and the step count on the host: torch's casts every floating
        state to its parameter's dtype (fp32), which would double the moments' memory (all of them at once, on the
        device) until the next cast. The moments are set aside, the rest loaded by torch, then the moments put back
        on each parameter's device in bf16 (a checkpoint of fp32 moments, e.g. torch's AdamW, is converted)."""
        state_dict = dict(state_dict)
        saved = {pid: dict(s) for pid, s in state_dict.get("state", {}).items()}
        moments = {pid: {k: s.pop(k) for k in MOMENT_KEYS if k in s} for pid, s in saved.items()}
        super().load_state_dict({**state_dict, "state": saved})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            state = self.state.get(p)
            if state is None:
                continue
            for key, value in moments.get(pid, {}).items():
                state[key] = value.to(device=p.device, dtype=torch.bfloat16)
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().to("cpu", torch.float32)
                self._steps[id(p)] = int(state["step"])

    def sync_steps(self) -> None:
        """The host mirror of the step counts read again from the state (whose `step` tensors were set outside
        `step` / `load_state_dict`: checkpoint/manager.py `undo_state_init_step`)."""
        self._steps = {id(p): int(s["step"]) for p, s in self.state.items() if torch.is_tensor(s.get("step"))}

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # on the host: no device read to use it
            for key in MOMENT_KEYS:
                state[key] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            self._steps[id(p)] = 0
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            # tensors with the same step count go in one call (all of them, unless parameters were added later)
            calls: dict[int, tuple[list, list, list, list, list]] = {}
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWBf16Moments does not support sparse gradients")
                state = self._init_state(p)
                n = self._steps.get(id(p), 0) + 1
                self._steps[id(p)] = n
                state["step"].fill_(n)
                pieces = local_pieces([p, p.grad, state["exp_avg"], state["exp_avg_sq"]])
                if pieces is None:  # FSDP2 redistributes a Partial gradient before the step: not met in a job
                    raise RuntimeError(f"AdamWBf16Moments: parameter {self._names.get(id(p), pi)} has a Partial or "
                                       "differently placed gradient / state, which its elementwise update on the local "
                                       "tensors cannot take; use optimizer.moments_dtype = \"fp32\"")
                lists = calls.setdefault(n, ([], [], [], [], []))
                for dst, t in zip(lists, pieces):
                    dst.append(t)
                lists[4].append(self._keys.get(id(p), gi * 1_000_003 + pi))
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for step, (ps, gs, ms, vs, keys) in calls.items():
                seed = (self.seed * 1_000_003 + step * 7919) & 0x7FFFFFFF
                kernels.adamw_bf16_moments(ps, gs, ms, vs, lr=lr, beta1=float(beta1), beta2=float(beta2),
                                           eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                           step=step, seed=seed, keys=keys)
        return loss
