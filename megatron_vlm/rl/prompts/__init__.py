"""GRPO prompts: the prompt table (`dataset.py`), the train / held-out sets from `[data]` (`sets.py`),
their encoding into rollout prompts (`encoder.py`) and the start-up filter of over-long prompts
(`lengths.py`). Import the submodules directly; this file imports none of them."""
