"""GRPO reinforcement learning; README.md in this folder walks the layout.

The job (`trainer.py`: its parts and the loop's step object) runs one `GRPOStep` per step
(`grpo_step.py`), which wires the rounds (`rounds.py`: rollout, rewards, advantages, dynamic sampling),
the policy update (`policy_update.py`: packs, reference / old log-probs, loss, optimizer) and the step
metrics (`step_metrics.py`). Algorithms are registered by name in `algorithms/`; prompts live in
`prompts/`, the asynchronous loop in `asynchronous/`, verifiers in `rewards/`; the rollout engine is the
shared inference service `megatron_vlm.inference`.

Submodules are imported explicitly (`from megatron_vlm.rl.losses import ...`); this package file
imports nothing so that reward worker processes start without torch.
"""
