"""Rollout engines for GRPO: the interface (`engine.py`), next-token sampling (`sampling.py`), stop
criteria (`stopping.py`), and the built-in engine that generates with the policy model itself
(`policy_engine.py`). Import the submodules directly: this package file imports none of them, so
importing one never cycles back through the package."""
