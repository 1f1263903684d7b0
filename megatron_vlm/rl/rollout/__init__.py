"""Rollout engines for GRPO: the interface (`engine.py`), next-token sampling, stop criteria, and
the built-in engine that generates with the policy model itself (`policy_engine.py`)."""
from megatron_vlm.rl.rollout.engine import RolloutEngine, RolloutPrompt, RolloutResult, RolloutSample, SamplingParams
from megatron_vlm.rl.rollout.policy_engine import PolicyRolloutEngine

__all__ = ["RolloutEngine", "RolloutPrompt", "RolloutResult", "RolloutSample", "SamplingParams", "PolicyRolloutEngine"]
