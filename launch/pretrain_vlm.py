#!/usr/bin/env python
"""The one entry point for every job kind.

    torchrun --nproc_per_node N launch/pretrain_vlm.py --config x.toml [--set section.key=value ...] [--unset section.key ...]
    python launch/pretrain_vlm.py --config x.toml            # one process
    python launch/pretrain_vlm.py --config x.toml --check --world-size 8 --device-memory-gib 80
                                                              # will it start and fit? (no weights)

`[train] mode` picks the job ("sft", "grpo", "dpo": preference optimisation, see docs/dpo.md, "reward":
reward-model training, see docs/reward_models.md, or "eval": benchmark evaluation, see launch/evaluate.py). Config errors exit with code 2 and one line;
SIGTERM (SLURM preemption) saves a checkpoint and exits with 143; process groups are torn down on
success, error and Ctrl-C.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The folder the job starts in, last: relative paths in a config are read from there, and so is a user's module
# named by dotted path (`rl.rewards` custom functions, `rl.env.name`; reward workers inherit sys.path), as with
# `python -m`; searched after everything else, it shadows no installed package.
if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())

from megatron_vlm.config import ConfigError, load_config  # noqa: E402
from megatron_vlm.config.loader import die  # noqa: E402
from megatron_vlm.config.mode_keys import check_keys_for_mode  # noqa: E402
from megatron_vlm.config.unset import UNSET_PREFIX  # noqa: E402
from megatron_vlm.runner import run_entry, run_job  # noqa: E402

LAUNCHER_VARIABLES = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}
"""The variables torchrun sets for each rank, and the least value each may take."""


def check_launcher_variables() -> None:
    """Exit 2 naming a WORLD_SIZE / RANK / LOCAL_RANK that is not a whole number at least its least value.

    Why: they are read with int() in several places (the --world-size default, the log prefix, the process
    group); a value set by hand or by a wrapper script ended in a ValueError traceback from whichever came first."""
    for name, least in LAUNCHER_VARIABLES.items():
        value = os.environ.get(name)
        if value is None:
            continue
        try:
            ok = int(value) >= least
        except ValueError:
            ok = False
        if not ok:
            print(f"error: environment variable {name}={value!r} is not a whole number >= {least} (torchrun sets "
                  "WORLD_SIZE, RANK and LOCAL_RANK for each rank; unset them for a one-process run)", file=sys.stderr)
            raise SystemExit(2)


class _Unset(argparse.Action):
    """`--unset KEY` as the item `~KEY` in the `--set` list: one list keeps the order of both (config/unset.py)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), f"{UNSET_PREFIX}{values}"])


class _Once(argparse.Action):
    """`--config` given once: a second one is an error (exit 2), not the first file silently dropped (argparse keeps
    the last value; a user layering a base config and a change got the change alone, every other key its default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r}, then {values!r}): one "
                         "config file per run; change its keys with --set / --unset")
        setattr(namespace, self.dest, values)


def parse_args(argv=None, description: str = "Train or evaluate a vision-language model (SFT, GRPO, DPO or eval)."):
    # whole option names only: launch/slurm/resolve_output_dir.py, which picks the run folder before the job starts,
    # reads `--set` / `--unset` by their whole names; an abbreviation (`--se train.output_dir=/x`) trained elsewhere
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--config", required=True, action=_Once, help="TOML config file (once)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (value parsed as TOML; bare words are strings; an entry of an "
                        "array of tables as rl.rewards[0].weight=0.5; a section's inline table sets the keys it "
                        "names: optimizer={lr=1e-4} = optimizer.lr=1e-4)")
    p.add_argument("--unset", dest="overrides", action=_Unset, default=[], metavar="SECTION.KEY",
                   help="remove a key the config file sets, so that its default applies (a whole table: --unset eval; "
                        "a key of an entry: stages[0].lr); applied in order with --set (also written --set '~KEY'); "
                        "a key the file does not set, or a list entry, exits 2")
    p.add_argument("--check", action="store_true",
                   help="resolve the config, build the model on the meta device, check sizes and memory per rank; "
                        "exit 0 with the plan or 2 naming the key to change (no weights, no process group)")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="ranks of the planned run (--check; default $WORLD_SIZE or 1)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory of one device in GiB (--check; default: the visible accelerator's)")
    return p.parse_args(argv)


def main(argv=None, *, before_step=None, description: Optional[str] = None) -> int:
    """Parse, load and run; `before_step(n)` is passed to the training loop (tests only: see
    tests/integration/fault_entry.py); `description`: the help text of another entry point
    (launch/evaluate.py)."""
    check_launcher_variables()
    args = parse_args(argv, description) if description else parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_keys_for_mode(cfg)
    except ConfigError as e:
        die(str(e))
    if args.check:
        from megatron_vlm.plan.check import run_check

        # under torchrun every rank plans the same run: rank 0 prints the plan, every rank exits with its code
        quiet = int(os.environ.get("RANK", 0)) != 0
        out, err = (io.StringIO(), io.StringIO()) if quiet else (sys.stdout, sys.stderr)
        return run_check(cfg, world_size=args.world_size, device_memory_gib=args.device_memory_gib, out=out, err=err)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S",
    )
    return run_job(cfg, before_step=before_step)


if __name__ == "__main__":
    run_entry(main)  # no interpreter finalization after a job, nor after a crash (runner.run_entry)
