"""GRPO reinforcement learning: config, rewards, advantages, losses, prompt data (and, later, the
rollout engine and the sync / async controllers).

Submodules are imported explicitly (`from megatron_vlm.rl.losses import ...`); this package file
imports nothing so that reward worker processes start without torch.
"""
