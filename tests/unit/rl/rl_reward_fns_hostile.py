"""Custom reward functions that misbehave the ways users' functions were seen to (issue: reliability pass):
imported by the reward workers of tests/unit/rl/test_reward_hostile.py."""
import subprocess
import sys


def no_kwargs(completion, answer):
    """The common mistake: no prompt / metadata / **kwargs parameters."""
    return 1.0


def with_scale(completion, answer, *, scale, prompt="", metadata=None):
    return scale


def huge_int(completion, answer, **kwargs):
    return -(10**400) if completion == "neg" else 10**400


def a_string(completion, answer, **kwargs):
    return "0.75"


def none(completion, answer, **kwargs):
    return None


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def raise_unprintable(completion, answer, **kwargs):
    raise Unprintable()


def always_raises(completion, answer, **kwargs):
    raise ValueError("broken verifier")


def spawn_children_and_hang(completion, answer, *, metadata=None, **kwargs):
    """Start grandchildren that ignore SIGTERM (they inherit the worker's ignored SIGTERM), record their pids, hang."""
    code = "import time\nwhile True: time.sleep(0.05)"
    kids = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    with open(metadata["pid_file"], "w") as f:
        f.write(" ".join(str(k.pid) for k in kids))
    while True:
        pass
