"""Reward functions of the stop-during-a-step job tests (imported by dotted path in the reward workers)."""
import os
import threading
import time


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
