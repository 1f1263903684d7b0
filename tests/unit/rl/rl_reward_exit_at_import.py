"""A reward module that ends the process while it is imported (tests/unit/rl/test_reward_hostile.py)."""
import os

os._exit(3)


def fn(completion, answer, **kwargs):  # never reached
    return 1.0
