"""`eval_results.json` records every setting that changes an evaluation's result, with the value the job ran with,
so a result can be reproduced from the file alone: a real tiny evaluation job (launch/evaluate.py) with every such
key set away from its default.

The lists below are this test's own reading of the config docs: which keys decide what is generated and how it is
scored (EVAL_AFFECTING, DATA_AFFECTING) and which only decide how fast or where the job runs (the *_NOT_AFFECTING
lists). A key added to [eval] or [data] later must be put in one of them: the last test fails until it is."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from jobs import REPO

from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.data.config import DataConfig
from megatron_vlm.kernels.config import KernelsConfig
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.fixtures.benchmark_files import write_mathvista
from tests.fixtures.eval_config import write_eval_config

sys.path.insert(0, str(REPO / "launch"))
import evaluate  # noqa: E402

EVAL_AFFECTING = {"greedy": False, "samples": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 3,
                  "stop": ["\n\n"], "batch_size": 3, "prompt_template": "Q: {problem}", "system_prompt": "Answer briefly.",
                  "correct_threshold": 0.5, "reward_timeout_s": 7.5, "reasoning_end": "</think>"}
EVAL_NOT_AFFECTING = {"reward_workers"}  # verifier processes: how fast the scores come, not what they are
EVAL_RECORDED_APART = {"benchmarks", "adapter"}  # per benchmark below; adapter: none given (checked as None)
DATA_AFFECTING = {"chat_template_kwargs": {"enable_thinking": False}, "min_pixels": 3136, "max_pixels": 12544,
                  "video_min_pixels": 3136, "video_max_pixels": 50176, "max_frames": 8, "fps": 1.0,
                  "max_image_pixels": 10_000_000, "max_video_pixels": 20_000_000, "video_decode_timeout_s": 30.0,
                  "max_tokens_per_pack": 600}
# loader processes and caches (speed), and the keys an evaluation refuses (it reads [[eval.benchmarks]] instead)
DATA_NOT_AFFECTING = {"num_workers", "prefetch_factor", "loader_timeout_s", "length_cache_dir", "type", "train_path",
                      "eval_path", "image_root", "columns", "shuffle", "synthetic_dir", "synthetic_train_size",
                      "synthetic_eval_size", "synthetic_seed", "synthetic_image_size"}
KERNELS = {"rms_norm": "torch"}


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_settings")
    model = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "model")
    template = model / "chat_template.jinja"  # reads enable_thinking, so data.chat_template_kwargs may name it
    template.write_text("{% if enable_thinking is defined %}{% endif %}" + template.read_text())
    bench_path, _ = write_mathvista(tmp / "bench")
    bench = {"name": "mv", "path": bench_path, "format": "mathvista", "columns": {"id": "pid"},
             "verifier": "short_answer", "image_root": tmp / "bench", "max_samples": 3}  # eval.prompt_template's
    cfg = write_eval_config(tmp / "eval.toml", model, tmp / "out", [bench], data=DATA_AFFECTING,
                            eval=EVAL_AFFECTING, train={"seed": 7, "precision": "fp32"}, kernels=KERNELS)
    assert evaluate.main(["--config", str(cfg)]) == 0
    return json.loads((tmp / "out" / "eval_results.json").read_text())["settings"], bench, model


def test_every_result_affecting_key_is_recorded_with_its_value(settings):
    got, bench, model = settings
    assert {k: got.get(k, "<missing>") for k in EVAL_AFFECTING} == EVAL_AFFECTING
    assert got["adapter"] is None
    assert got.get("data") == DATA_AFFECTING
    assert got["model"] == str(model) and got.get("model_dtype") == "float32"
    assert got["seed"] == 7 and got.get("precision") == "fp32" and got["world_size"] == 1
    assert {k: got.get("kernels", {}).get(k) for k in KERNELS} == KERNELS
    assert {k: got.get("parallel", {}).get(k) for k in ("tp", "cp", "ep", "dp_shard", "dp_replicate")} == \
        {"tp": 1, "cp": 1, "ep": 1, "dp_shard": -1, "dp_replicate": 1}
    want = {k: str(v) if k in ("path", "image_root") else v for k, v in bench.items() if k != "name"}
    want["prompt_template"] = None  # its own: none, so eval.prompt_template (recorded above)
    assert got.get("benchmarks", {}).get("mv") == want


def test_every_config_key_is_judged_by_this_test():
    """A new [eval] / [data] / [[eval.benchmarks]] / [kernels] key needs a place in the lists above."""
    judged = set(EVAL_AFFECTING) | EVAL_NOT_AFFECTING | EVAL_RECORDED_APART
    assert {f.name for f in dataclasses.fields(EvalConfig)} == judged
    assert {f.name for f in dataclasses.fields(DataConfig)} == set(DATA_AFFECTING) | DATA_NOT_AFFECTING
    assert {f.name for f in dataclasses.fields(BenchmarkConfig)} == {"name", "path", "format", "columns", "verifier",
                                                                     "prompt_template", "image_root", "max_samples"}
    assert set(KERNELS) <= {f.name for f in dataclasses.fields(KernelsConfig)}
