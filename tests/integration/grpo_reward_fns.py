"""Reward functions for the GRPO integration tests (imported by dotted path in reward workers)."""


def text_length(completion, answer, *, prompt="", metadata=None, cap=12):
    """A graded reward that a random tiny model already spreads over [0, 1]: longer is better."""
    return min(len(completion), cap) / cap


def first_word_is(completion, answer, *, prompt="", metadata=None, word="red"):
    """1 when the completion's first word is `word`, whatever the question: a target any policy
    can learn quickly, to check that the GRPO loop moves the policy towards higher reward."""
    words = completion.strip().split()
    return float(bool(words) and words[0].strip(".,!").lower() == word)
