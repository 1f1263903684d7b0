"""Evaluation: answer accuracy (Avg@k, pass@k) scored with the reward verifiers.

Import from the modules (`megatron_vlm.eval.accuracy`); this file imports nothing.
"""
