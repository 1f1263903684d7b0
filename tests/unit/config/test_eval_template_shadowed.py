"""`eval.prompt_template` is the template of the benchmarks without their own: with every `[[eval.benchmarks]]` table
setting `prompt_template`, it is never read, and `--set eval.prompt_template=...` changed no prompt of the run (its
results files still recorded each benchmark's own). Refused, naming the key; a benchmark without its own still takes
it."""
from __future__ import annotations

import pytest

from megatron_vlm.config import ConfigError, load_config_dict


def _raw(*own: bool, template: str = "Q: {problem}") -> dict:
    benchmarks = [{"name": f"b{i}", "path": f"b{i}.jsonl", "format": "messages",
                   **({"prompt_template": "{problem} Answer briefly."} if mine else {})} for i, mine in enumerate(own)]
    return {"model": {"path": "m"}, "train": {"mode": "eval"},
            "eval": {"prompt_template": template, "benchmarks": benchmarks}}


def test_a_template_every_benchmark_replaces_is_refused():
    with pytest.raises(ConfigError, match=r"^eval\.prompt_template: every \[\[eval\.benchmarks\]\] table sets its own"):
        load_config_dict(_raw(True, True))


def test_a_benchmark_without_its_own_takes_it():
    cfg = load_config_dict(_raw(True, False))
    assert cfg.eval.prompt_template == "Q: {problem}" and cfg.eval.benchmarks[1].prompt_template is None
    load_config_dict(_raw(True, True, template="{problem}"))  # the default template: nothing set
