"""Environments for the multi-turn tests (imported by dotted path in the worker processes too)."""
import contextlib
import os
import time

import numpy as np

from megatron_vlm.rl.env.base import Environment, Observation, StepResult
from megatron_vlm.rl.env.tools import ToolEnvironment


class ImageSecondTurn(Environment):
    """Turn 1 is answered with a new image and a question (so turn 2 sees an image that arrived mid-conversation);
    turn 2 ends the trajectory with reward 1 (+ 0.5 per turn reward: 0.5 at turn 1)."""

    def __init__(self, size: int = 56, turns: int = 2, sizes: tuple = ()):
        self.size, self.turns, self.sizes = size, turns, tuple(sizes)
        self.t = 0

    def step(self, action):
        self.t += 1
        if self.t >= self.turns:
            return StepResult(Observation(), reward=1.0, done=True)
        rng = np.random.default_rng(self.t)
        size = self.sizes[sum(map(ord, self.sample.problem)) % len(self.sizes)] if self.sizes else self.size
        img = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
        return StepResult(Observation(text="what is in this picture", images=[img]), reward=0.5, info={"images": 1})


class Echo(Environment):
    """Never done: replies with text (for the max_turns / max_total_tokens limits)."""

    def __init__(self, text: str = "go on"):
        self.text = text

    def step(self, action):
        return StepResult(Observation(text=self.text), reward=0.25)


class Hang(Environment):
    def step(self, action):
        time.sleep(3600)


class SleepFor(Environment):
    """A turn that waits `seconds` (a hung network call / subprocess: blocked in a system call), then ends."""

    def __init__(self, seconds: float = 3600.0):
        self.seconds = seconds

    def step(self, action):
        time.sleep(self.seconds)
        return StepResult(Observation(), reward=1.0, done=True)


class SpinFor(SleepFor):
    """A turn that computes for `seconds` in Python (a runaway loop), then ends."""

    def step(self, action):
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass
        return StepResult(Observation(), reward=1.0, done=True)


class Crash(Environment):
    def step(self, action):
        os._exit(3)


class Raise(Environment):
    def step(self, action):
        raise RuntimeError("environment bug")


class HangOnReset(Environment):
    def reset(self, sample):
        time.sleep(3600)


class VideoSecondTurn(ImageSecondTurn):
    """Turn 1 is answered with a 4-frame video (and text); turn 2 ends the trajectory."""

    def step(self, action):
        self.t += 1
        if self.t >= self.turns:
            return StepResult(Observation(), reward=1.0, done=True)
        rng = np.random.default_rng(self.t)
        frames = [rng.integers(0, 255, size=(self.size, self.size, 3), dtype=np.uint8) for _ in range(4)]
        return StepResult(Observation(text="what happens", videos=[frames], video_fps=2.0), reward=0.5)


class CrashOn(Echo):
    """Echo, but its worker process dies at the first step of a trajectory whose problem contains `word`."""

    def __init__(self, word: str = "seven", text: str = "go on"):
        super().__init__(text)
        self.word = word

    def step(self, action):
        if self.word in self.sample.problem:
            os._exit(3)
        return super().step(action)


class RewardOf(Environment):
    """Done at the first turn with the reward `value` (any float: NaN and infinities for the reward checks)."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def step(self, action):
        return StepResult(Observation(), reward=self.value, done=True)


class InfoOf(Environment):
    """Done at the first turn, reporting `info` as its counters (any value: the checks of what a step returns)."""

    def __init__(self, info=None):
        self.info = info

    def step(self, action):
        return StepResult(Observation(), reward=1.0, done=True, info=self.info)


class Exits(Environment):
    """Calls sys.exit in its step (a script's habit)."""

    def step(self, action):
        import sys

        sys.exit(5)


class AllocateOn(Echo):
    """Echo, but its step allocates `mib` MiB (and touches them) in a trajectory whose problem contains `word`."""

    def __init__(self, word: str = "", mib: int = 2048, text: str = "go on"):
        super().__init__(text)
        self.word, self.mib = word, int(mib)

    def step(self, action):
        if self.word in self.sample.problem:
            block = bytearray(self.mib * 2**20)
            block[:: 2**12] = b"\1" * len(block[:: 2**12])  # every page: real memory, not only address space
            return StepResult(Observation(text=str(len(block))), reward=0.25)
        return super().step(action)


def worker_without_address_cap(conn, preload=(), memory_limit_mb=0, parent_pid=0):
    """The environment worker on a platform whose setrlimit accepts RLIMIT_AS without enforcing it."""
    import resource

    resource.setrlimit = lambda *a: None
    from megatron_vlm.rl.env.pool import _env_worker_main

    _env_worker_main(conn, preload, memory_limit_mb, parent_pid)


class RaiseOnReset(Echo):
    """Its reset raises (an environment that cannot be built for a sample)."""

    def reset(self, sample):
        raise RuntimeError("no such level")


class StepReturnsDict(Environment):
    """A gym / TRL habit: a dict instead of a StepResult."""

    def step(self, action):
        return {"observation": "4", "reward": 1.0, "done": False}


class ObservationIsText(Environment):
    """The observation given as a bare string instead of an Observation."""

    def step(self, action):
        return StepResult(observation="the tool says 4")


class ImageNotInAList(Environment):
    """One image where the Observation wants a list of them."""

    def step(self, action):
        return StepResult(Observation(text="look", images=np.zeros((28, 28, 3), dtype=np.uint8)))


class TextNotAString(Environment):
    def step(self, action):
        return StepResult(Observation(text=4))


class ResetReturnsNothing(Environment):
    """`reset` that forgets to return its Observation."""

    def reset(self, sample):
        self.sample = sample


class RewardNotANumber(Environment):
    def step(self, action):
        return StepResult(Observation(text="x"), reward="high")


class DoneWithoutObservation(Environment):
    """Ends at once; the observation of a final step is not shown, so None is fine."""

    def step(self, action):
        return StepResult(None, reward=np.float32(1.0), done=True)


class NeedsAnArgument(Environment):
    """Built only with `[rl.env] kwargs = {level = ...}`."""

    def __init__(self, level: int):
        self.level = level

    def step(self, action):
        return StepResult(Observation(), done=True)


class ToolsRaise(Environment):
    def tools(self):
        raise RuntimeError("no tool box")


class ToolsOfTheSample(Environment):
    """Per-sample tools (verl's tools_kwargs habit): a `lookup` tool only for samples whose problem asks for one."""

    def tools(self):
        wanted = "lookup" in getattr(self, "sample", None).problem if hasattr(self, "sample") else False
        return [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}] if wanted else []

    def step(self, action):
        return StepResult(Observation(), done=True)


class StackedImages(Environment):
    """Two images as one N x H x W x 3 array (a sequence of images, as a list of them would be)."""

    def step(self, action):
        return StepResult(Observation(text="look", images=np.zeros((2, 28, 28, 3), dtype=np.uint8)))


class VideoAsArray(Environment):
    """One video as a T x H x W x 3 array of frames."""

    def step(self, action):
        return StepResult(Observation(text="watch", videos=[np.zeros((4, 28, 28, 3), dtype=np.uint8)]))


class VideoAtRate(Environment):
    """A video of 4 frames at `fps` frames per second (the observation's video_fps)."""

    def __init__(self, fps: float = 2.0):
        self.fps = fps

    def step(self, action):
        frames = [np.full((28, 28, 3), 40 * i, dtype=np.uint8) for i in range(4)]
        return StepResult(Observation(text="watch", videos=[frames], video_fps=self.fps))


class LongVideo(Environment):
    """A video of `frames` frames of `size` x `size` pixels (frame i filled with the value i), and a `size` x `size`
    image when `image` is set."""

    def __init__(self, frames: int = 40, size: int = 28, image: bool = False):
        self.frames, self.size, self.image = frames, size, image

    def step(self, action):
        video = [np.full((self.size, self.size, 3), i, dtype=np.uint8) for i in range(self.frames)]
        images = [np.zeros((self.size, self.size, 3), dtype=np.uint8)] if self.image else []
        return StepResult(Observation(text="watch", videos=[video], images=images, video_fps=4.0))



def _slow_tool(seconds: float) -> str:
    """Sleep `seconds`, then answer (a tool that hangs when `seconds` is large)."""
    time.sleep(seconds)
    return "slept"


def _stubborn_tool(seconds: float) -> str:
    """Sleep `seconds` through any interruption (a careless tool's bare except), then answer."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(BaseException):  # what a careless tool does
            time.sleep(max(0.0, end - time.monotonic()))
    return "finished"


def _paid(text, sample):
    return 1.0


class SlowTools(ToolEnvironment):
    """Tools `_slow_tool(seconds)` and `_stubborn_tool(seconds)`; a turn without a call ends the trajectory (reward 1)."""

    def __init__(self):
        super().__init__([_slow_tool, _stubborn_tool], reward_fn=_paid)
