"""`parallel.ep` sizes the model cannot take are refused by the job with exit 2 and a line naming the key and the
numbers, as `--check` refuses them: a dense model (no routed experts to split) and an expert count ep does not
divide. They used to escape the job as a ValueError traceback from the expert-parallel plan (exit 1, every rank
dumping its stack). Checked on meta-device models before anything is placed: no process group, no weights."""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.errors import ConfigError
from megatron_vlm.models import build_model, get_family
from megatron_vlm.parallel import ParallelDims
from tests.fixtures.real_configs import real_config
from tests.integration.parallel.test_tp_errors import _FakeMesh


def _meta(name: str, **text) -> torch.nn.Module:
    cfg = real_config(name)
    cfg.get("text_config", cfg).update(text)
    with torch.device("meta"):
        return build_model(cfg)


def test_job_refuses_ep_on_a_dense_model():
    model = _meta("qwen2_5_math_1_5b", num_hidden_layers=2)
    dims = ParallelDims(1, 2, 2, ep=2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 2: .*no MoE blocks.*set parallel\.ep = 1"):
        get_family("qwen2").parallelize(model, dims, ParallelConfig(ep=2), mesh=_FakeMesh(1))


def test_job_refuses_ep_that_does_not_divide_the_experts():
    model = _meta("qwen3_vl_30b_a3b", num_hidden_layers=4, num_experts=6, num_experts_per_tok=2)  # ep 4 divides 8 ranks, not 6 experts
    dims = ParallelDims(1, 8, 8, ep=4)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 4 does not divide the model's 6 routed experts"):
        get_family("qwen3_vl_moe").parallelize(model, dims, ParallelConfig(ep=4), mesh=_FakeMesh(1))
