"""Asynchronous GRPO (`[rl] allocation`): the rank split (`allocation.py`), the role groups and the bridge
between training rank 0 and the rollout ranks (`bridge.py`), the rollout ranks' loop (`rollout_rank.py`),
the training ranks' loop step (`trainer.py`) and the weight push (`weights.py`). Import the submodules
directly; this file imports none of them."""
