"""Evaluation of every job kind, in one place:

- `heldout_loss`: held-out loss / perplexity of the eval split (SFT);
- `answer_accuracy` / `answers`: greedy answer accuracy with the rollout engine, overall and per
  record group (SFT); `sft.SFTEvaluator` runs both at a step;
- `accuracy`: Avg@k / pass@k scored with the reward verifiers; `grpo_accuracy`: the GRPO held-out
  evaluation with the rollout engine;
- the evaluation job (`[train] mode = "eval"`, launch/evaluate.py): `config` (the `[eval]` section),
  `benchmarks` (column adapters of the public benchmark releases), `benchmark_eval` (greedy and
  sampled scoring through `answer_accuracy.generate_answers`), `report` (eval_results.json / .md),
  `settings` (the run's settings those record), `resume` (the benchmarks a stopped job finished, kept).

Import from the modules (`megatron_vlm.eval.accuracy`); this file imports nothing.
"""
