#!/usr/bin/env python
"""Evaluate a model folder on benchmark files: greedy accuracy and sampled Avg@k / pass@k per
benchmark, scored with the training verifiers (math, choice, exact_match, short_answer).

    python launch/evaluate.py --config x.toml [--set eval.samples=8 ...] [--unset optimizer ...]
    torchrun --nproc_per_node N launch/evaluate.py --config x.toml     # the files split over N ranks

The same job as `launch/pretrain_vlm.py` with `[train] mode = "eval"` (this entry point sets it, so
a config may leave `[train]` out); the config needs `[model] path` and `[eval]` with at least one
`[[eval.benchmarks]]` table (docs/evaluation.md). Results go to `train.output_dir`:
eval_results.json, eval_results.md, eval_predictions/ and the resolved config as eval_config.toml (never
config.toml: pointed at a training run's folder, the run's own config.toml stays as it is). Config errors,
and a folder another job is writing to, exit with code 2. A stopped job's finished benchmarks stay in
eval_partial/ for the job run again in the folder (megatron_vlm/eval/resume.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_vlm.config.loader import ConfigError, die, parse_override_value  # noqa: E402


def _refuse_a_training_mode(argv: list[str]) -> None:
    """Exit 2 when a `--set train.mode=...` (or an inline `--set train={mode=...}`) asks for anything but "eval", or an `--unset` would take away the
    train.mode = "eval" this entry point sets (`train.mode`, `train`): it never trains."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the --set items, as launch/pretrain_vlm.py reads them
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--unset", dest="unsets", action="append", default=[])
    args = p.parse_known_args(argv)[0]
    overrides = args.overrides
    unsets = [u.strip() for u in args.unsets] + [o.lstrip()[1:].strip() for o in overrides if o.lstrip().startswith("~")]
    for key in unsets:
        if key in ("train", "train.mode"):
            die(f"{key}: launch/evaluate.py sets train.mode = \"eval\"; --unset {key} would take it away (the default "
                "mode trains); unset the other keys one by one")
    modes = []
    try:
        for key, sep, text in (o.partition("=") for o in overrides):
            if sep and key.strip() == "train.mode":
                modes.append(parse_override_value(text.strip(), "train.mode"))
            elif sep and key.strip() == "train":  # an inline table sets the keys it names (config/loader.py `_expand`)
                table = parse_override_value(text.strip(), "train")
                if isinstance(table, dict) and "mode" in table:
                    modes.append(table["mode"])
    except ConfigError as e:
        die(str(e))
    if modes and modes[-1] != "eval":
        die(f"train.mode: launch/evaluate.py only evaluates (train.mode = \"eval\"), got --set train.mode={modes[-1]!r}; "
            "train with launch/pretrain_vlm.py")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _refuse_a_training_mode(argv)
    from pretrain_vlm import main as _main  # the job's whole import tree: after the command line is known to be an eval

    # first, so that the config's own train.mode (a training run's config) gives way; a --set train.mode=... other
    # than "eval" was refused above
    return _main(["--set", 'train.mode="eval"', *argv], description="Evaluate a model on benchmark files.")


if __name__ == "__main__":
    from megatron_vlm.runner import run_entry

    run_entry(main)
