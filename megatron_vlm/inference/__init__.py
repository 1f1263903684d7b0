"""Generation with the policy: the engine interface (`engine.py`), the built-in engine that decodes with the
model itself (`policy_engine.py`), next-token sampling (`sampling.py`, `generators.py`), stop criteria
(`stopping.py`), CUDA-graph decode steps (`decode_graphs.py`) and the KV-cache budget (`kv_budget.py`).
Shared by GRPO rollouts (`megatron_vlm/rl`) and the evaluations (`megatron_vlm/eval`). Import the
submodules directly: this package file imports none of them, so importing one never cycles back."""
