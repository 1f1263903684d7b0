"""Verifiable rewards for GRPO: built-in verifiers (math, multiple choice, format, exact match),
custom functions by dotted path, and the worker pool that runs every call under a timeout.

Import the pieces from their modules (`megatron_vlm.rl.rewards.manager.RewardManager`); this file
stays import-free so that worker processes start quickly.
"""
