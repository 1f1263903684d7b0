#!/usr/bin/env python
"""Evaluate a model folder on benchmark files: greedy accuracy and sampled Avg@k / pass@k per
benchmark, scored with the training verifiers (math, choice, exact_match, short_answer).

    python launch/evaluate.py --config x.toml [--set eval.samples=8 ...]
    torchrun --nproc_per_node N launch/evaluate.py --config x.toml     # the files split over N ranks

The same job as `launch/pretrain_vlm.py` with `[train] mode = "eval"` (this entry point sets it, so
a config may leave `[train]` out); the config needs `[model] path` and `[eval]` with at least one
`[[eval.benchmarks]]` table (docs/evaluation.md). Results go to `train.output_dir`:
eval_results.json, eval_results.md, eval_predictions/ and the resolved config as eval_config.toml (never
config.toml: pointed at a training run's folder, the run's own config.toml stays as it is). Config errors,
and a folder another job is writing to, exit with code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_vlm import main as _main  # noqa: E402

from megatron_vlm.runner import exit_process  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # first, so that an explicit --set train.mode=... on the command line still wins (and is refused
    # by the mode checks if it is not "eval")
    return _main(["--set", 'train.mode="eval"', *argv], description="Evaluate a model on benchmark files.")


if __name__ == "__main__":
    exit_process(main())
