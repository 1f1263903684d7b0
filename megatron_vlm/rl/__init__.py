"""GRPO reinforcement learning: config, rewards, advantages, losses, prompt data, the rollout engine
(`rollout/`) and the GRPO step (`grpo_step.py`, run by the shared training loop through
`trainer.GRPOLoopStep`); see README.md in this folder.

Submodules are imported explicitly (`from megatron_vlm.rl.losses import ...`); this package file
imports nothing so that reward worker processes start without torch.
"""
