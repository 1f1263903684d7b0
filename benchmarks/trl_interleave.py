"""The timing callback the TRL comparison benchmarks share (trl_sft.py, trl_grpo.py, trl_dpo.py, trl_reward.py).

Why: the two sides run in one process, interleaved, so that the machine's load drifts over both alike: a TRL
`TrainerCallback` times each TRL step and, right after it, runs and times one of ours.
"""
from __future__ import annotations

import time
from collections.abc import Callable


def interleave_callback(times: dict[str, list[float]], our_step: Callable[[], float]):
    """A TrainerCallback appending each TRL step's seconds to times["trl"] and then `our_step()`'s to times["ours"]."""
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times["trl"].append(time.perf_counter() - self.t0)
            times["ours"].append(our_step())

    return Interleave()
