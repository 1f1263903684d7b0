"""Reward functions for the GRPO integration tests (imported by dotted path in reward workers)."""


def text_length(completion, answer, *, prompt="", metadata=None, cap=12):
    """A graded reward that a random tiny model already spreads over [0, 1]: longer is better."""
    return min(len(completion), cap) / cap
