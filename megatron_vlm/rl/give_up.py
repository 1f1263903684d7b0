"""All ranks agree whether one of them gave up a hung wait of the work they share, and say which wait it was.

Why an agreement: a rank that gave up a wait because the job is stopping (`WaitAbandoned`, rewards/pool.py) must not
skip a collective the other ranks make, so after the phase whose waits may be given up every rank calls
`agreed_give_up` (one all-reduce) and, when it returns a reason, all end that work together (a GRPO round: the step,
`StepAbandoned`; a held-out evaluation: `EvaluationAbandoned`). The reason names what was waited on (the verifiers,
the environments), on the rank that gave up and on the others alike.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_vlm.abandon import WaitAbandoned
from megatron_vlm.parallel.collectives import all_reduce_max

__all__ = ["WAITS", "agreed_give_up"]

WAITS = ("verifiers", "environments", "generation", "reward models")
"""The waits a rank may give up (`WaitAbandoned.waited_for`: the verifier pool, the environments, the built-in
engine's decode steps, the model rewards' forwards); any other is reported as "waits"."""


def agreed_give_up(gave_up: Optional[WaitAbandoned], device: torch.device) -> str:
    """"" when no rank gave up a wait (collective: every rank calls it); else the reason, the same kind on every
    rank: "this rank gave up waiting for its <what>: <detail>" or "another rank gave up waiting for its <what>"."""
    names = (*WAITS, "waits")
    mine = None if gave_up is None else (gave_up.waited_for if gave_up.waited_for in WAITS else "waits")
    flags = all_reduce_max([int(mine == name) for name in names], device)
    if not any(flags):
        return ""
    if gave_up is not None:
        return f"this rank gave up waiting for its {gave_up.waited_for}: {gave_up}"
    return f"another rank gave up waiting for its {' and '.join(n for n, f in zip(names, flags) if f)}"
