"""Reward functions of the stop-during-a-step job tests (imported by dotted path in the reward workers)."""
import os
import threading
import time

from megatron_vlm.rl.env.base import Environment, Observation, StepResult


def block_after(completion, answer, *, prompt="", metadata=None, calls=0, marker="", ranks=(0,)):
    """A hung verifier: scores like text_length for the first `calls` calls of its rank (counted in a file beside
    `marker`), then, on the ranks in `ranks`, writes `marker` and blocks forever (an Event never set). The rank is
    the job's (RANK, inherited by the worker from torchrun; 0 in a single process)."""
    rank = int(os.environ.get("RANK", "0"))
    count = f"{marker}.calls{rank}"
    with open(count, "a") as f:
        f.write("x")
    if os.path.getsize(count) <= calls or rank not in ranks:
        return min(len(completion), 12) / 12
    with open(marker, "w") as f:
        f.write(str(time.time()))
    threading.Event().wait()
    return 0.0


def nan_after(completion, answer, *, prompt="", metadata=None, calls=0, marker=""):
    """Scores like text_length for the first `calls` calls (counted in the file `marker`), then NaN on every call: a
    verifier that breaks mid-run."""
    with open(marker, "a") as f:
        f.write("x")
    if os.path.getsize(marker) <= calls:
        return min(len(completion), 12) / 12
    return float("nan")



class HangOnce(Environment):
    """An environment whose first step of the whole job (`marker` not yet written) writes `marker` and sleeps `seconds`,
    as a tool waiting on a server that died; every other step ends its trajectory."""

    def __init__(self, marker: str = "", seconds: float = 60.0):
        self.marker, self.seconds = marker, seconds

    def step(self, action):
        if not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(time.time()))
            time.sleep(self.seconds)
        return StepResult(Observation(), reward=1.0, done=True)
