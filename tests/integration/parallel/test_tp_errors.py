"""`parallel.tp` sizes that cannot work are refused with exit 2 and a line naming the key and the numbers:
by `--check` (the process count, a real InternVL3-8B config's 28 attention heads, a vocabulary) before
a job starts, and by the job itself (the model's KV heads, MLP width and vocabulary checked by the TP
plan before any weight is placed; `TPError` becomes the runner's config error). No process group."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.models import build_model, get_family
from megatron_vlm.parallel import ParallelDims
from megatron_vlm.parallel.tensor_parallel import TPError
from megatron_vlm.plan.check import run_check
from tests.fixtures.real_configs import real_config, write_real_model_folder

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "launch" / "configs" / "internvl3_8b_sft_tp2.toml"


def _check(folder: Path, world: int, *sets: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    cfg = load_config(CONFIG, [f'model.path="{folder}"', *sets])
    return run_check(cfg, world_size=world, device_memory_gib=80.0, out=out, err=err), err.getvalue()


@pytest.fixture(scope="module")
def internvl3_8b(tmp_path_factory) -> Path:
    return write_real_model_folder("internvl3_8b", tmp_path_factory.mktemp("internvl3_8b"))


def test_check_refuses_tp_that_does_not_divide(internvl3_8b, tmp_path):
    code, err = _check(internvl3_8b, 6, "parallel.tp=3")
    assert code == 2 and err.startswith("check failed: parallel.tp:"), err
    assert "3 does not divide language_model.layers.0.self_attn.num_attention_heads=28" in err, err
    code, err = _check(internvl3_8b, 6, "parallel.tp=4")
    assert code == 2 and err.startswith("check failed: parallel.tp: 4 does not divide the 6 ranks"), err
    code, err = _check(internvl3_8b, 8, "parallel.tp=8")  # vocab 151674 = 2 x 75837: checked first
    assert code == 2 and err.startswith("check failed: parallel.tp: 8 does not divide vocab_size=151674"), err
    # a vocabulary tp does not divide (the heads and the MLP do)
    cfg = json.loads((internvl3_8b / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 151673
    odd = tmp_path / "odd_vocab"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(cfg))
    code, err = _check(odd, 8, "parallel.tp=2")
    assert code == 2 and err.startswith("check failed: parallel.tp:") and "vocab_size=151673" in err, err


class _FakeMesh:
    """Only what the TP plan reads before it places anything: the named tp dim and its size."""
    mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    device_type = "cpu"

    def __init__(self, tp: int):
        self.tp = tp

    def __getitem__(self, name):
        return self

    def size(self) -> int:
        return self.tp


def _meta_model(**overrides) -> torch.nn.Module:
    cfg = real_config("qwen2_5_math_1_5b")  # 12 query / 2 KV heads, MLP 8960, vocab 151936
    cfg.update(overrides)
    with torch.device("meta"):
        return build_model(cfg)


@pytest.mark.parametrize("overrides, named", [
    ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
    ({"intermediate_size": 8961}, "intermediate_size=8961"),
    ({"vocab_size": 151935}, "vocab_size=151935"),
])
def test_job_refuses_tp_that_does_not_divide_the_model(overrides, named):
    model = _meta_model(**overrides)
    dims = ParallelDims(1, 1, 2, tp=2)
    with pytest.raises(TPError, match=r"parallel\.tp=2 does not divide .*" + named):
        get_family("qwen2").parallelize(model, dims, ParallelConfig(tp=2), mesh=_FakeMesh(2))
