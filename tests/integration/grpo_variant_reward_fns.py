"""Reward functions for the GRPO variants smoke test (imported by dotted path in reward workers)."""
import zlib


def half_constant(completion, answer, *, prompt="", metadata=None, cap=40):
    """The same reward (0.5) for every completion of half the prompts (by a stable hash of the
    question), a graded length reward for the others: half the groups have zero reward variance."""
    if zlib.crc32(prompt.encode()) % 2 == 0:
        return 0.5
    return min(len(completion), cap) / cap
