"""`[rl] rollout_backend` and `[rl.vllm]`: every key is accepted where it is read and refused (naming the
key, exit 2 from the launcher) where it is not; `allocation`'s engine prefix agrees with the back end;
the engine refuses what needs a device this job lacks before it imports vllm. No vllm needed."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_vlm.config import load_config
from megatron_vlm.config.loader import from_dict
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.asynchronous.allocation import parse_allocation
from megatron_vlm.rl.config import RLConfig, VLLMConfig

REPO = Path(__file__).resolve().parents[3]

ALL_KEYS = {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.3, "cpu_kv_cache_gib": 2.0, "enforce_eager": True,
            "max_num_seqs": 64, "max_model_len": 2048, "enable_prefix_caching": False, "sleep_mode": True, "sleep_level": 2,
            "weight_bucket_mb": 64}


def test_every_vllm_key_loads_with_the_vllm_backend():
    rl = from_dict(RLConfig, {"rollout_backend": "vllm", "vllm": ALL_KEYS}, "rl")
    assert rl.vllm == VLLMConfig(**ALL_KEYS)
    assert from_dict(RLConfig, {}, "rl").rollout_backend == "builtin"


@pytest.mark.parametrize("rl,want", [
    ({"rollout_backend": "sglang"}, r"^rl\.rollout_backend: must be one of"),
    ({"vllm": {"max_num_seqs": 8}}, r"^rl\.vllm: the \[rl\.vllm\] table is only read with rollout_backend = 'vllm'"),
    ({"allocation": "vllm:d1+d1"}, r"^rl\.allocation: 'vllm:d1\+d1' puts the rollout ranks on vLLM but rollout_backend"),
    ({"allocation": "sglang:d1+d1"}, r"^rl\.allocation: 'sglang:d1\+d1': the 'sglang' back end is not supported"),
    ({"allocation": "sglang:d1+d1", "rollout_backend": "vllm"}, r"^rl\.allocation: .*'sglang' back end is not supported"),
    ({"rollout_backend": "vllm", "vllm": {"tensor_parallel_size": 0}}, r"^rl\.vllm\.tensor_parallel_size: must be >= 1"),
    ({"rollout_backend": "vllm", "vllm": {"gpu_memory_utilization": 1.5}}, r"^rl\.vllm\.gpu_memory_utilization"),
    ({"rollout_backend": "vllm", "vllm": {"cpu_kv_cache_gib": 0}}, r"^rl\.vllm\.cpu_kv_cache_gib"),
    ({"rollout_backend": "vllm", "vllm": {"max_num_seqs": 0}}, r"^rl\.vllm\.max_num_seqs"),
    ({"rollout_backend": "vllm", "vllm": {"max_model_len": 1}}, r"^rl\.vllm\.max_model_len"),
    ({"rollout_backend": "vllm", "vllm": {"sleep_level": 3, "sleep_mode": True}}, r"^rl\.vllm\.sleep_level: must be 1 or 2"),
    ({"rollout_backend": "vllm", "vllm": {"sleep_level": 2}}, r"^rl\.vllm\.sleep_level: only read with sleep_mode"),
    ({"rollout_backend": "vllm", "vllm": {"weight_bucket_mb": 0}}, r"^rl\.vllm\.weight_bucket_mb"),
    ({"rollout_backend": "vllm", "vllm": {"swap_space": 4}}, r"^rl\.vllm\.swap_space"),  # unknown key: strict loader
    ({"rollout_backend": "vllm", "rollout": {"weights": "copy"}}, r"^rl\.rollout\.weights: a setting of the built-in engine"),
    ({"rollout_backend": "vllm", "rollout": {"cuda_graphs": "off"}}, r"^rl\.rollout\.cuda_graphs: a setting of the built-in engine; .*rl\.vllm\.enforce_eager"),
    ({"rollout_backend": "vllm", "rollout": {"kv_block_size": 16, "weights": "copy"}}, r"^rl\.rollout\.(weights|kv_block_size): a setting"),
    ({"rollout_backend": "vllm", "rollout": {"kv_block_size": 16, "kv_cache_blocks": 64, "weights": "copy"}},
     r"^rl\.rollout\.(weights|kv_block_size|kv_cache_blocks): a setting"),
    ({"rollout_backend": "vllm", "rollout": {"batch_prompts": 4}}, r"^rl\.rollout\.batch_prompts: a setting of the built-in engine"),
    ({"rollout_backend": "vllm", "rollout": {"memory_gib": 1.0}}, r"^rl\.rollout\.memory_gib: a setting of the built-in engine"),
    ({"rollout_backend": "vllm", "kv_block_size": 16}, r"^rl\.kv_block_size: .*rollout\.kv_block_size"),  # the old flat name
    # the rollout ranks generate all the time and hold no trainer: nothing would ever put their engine to sleep
    ({"rollout_backend": "vllm", "allocation": "vllm:d1+d1", "vllm": {"sleep_mode": True}},
     r"^rl\.vllm\.sleep_mode: the engines of the asynchronous rollout ranks \(allocation = 'vllm:d1\+d1'\)"),
    # vLLM 0.32 raises a temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__): measured, its log-probs at
    # rollout.temperature = 0.005 were 0.062 off the training forward's, 0 at 0.02
    ({"rollout_backend": "vllm", "rollout": {"temperature": 0.005}}, r"^rl\.rollout\.temperature: 0\.005 .*vLLM.* 0\.01"),
    ({"rollout_backend": "vllm", "eval": {"temperature": 0.005}}, r"^rl\.eval\.temperature: 0\.005 .*vLLM.* 0\.01"),
])
def test_refused_naming_the_key(rl, want):
    with pytest.raises(ConfigError, match=want):
        from_dict(RLConfig, rl, "rl")


def test_vllm_temperatures_from_0_01_load():
    rl = from_dict(RLConfig, {"rollout_backend": "vllm", "rollout": {"temperature": 0.01}, "eval": {"temperature": 0.0}}, "rl")
    assert (rl.rollout.temperature, rl.eval.temperature) == (0.01, 0.0)  # 0: greedy, which vLLM runs as such
    assert from_dict(RLConfig, {"rollout": {"temperature": 0.005}}, "rl").rollout.temperature == 0.005  # built-in


def test_allocation_keeps_the_engine_name():
    assert parse_allocation("vllm:d32+d16").engine == "vllm"
    assert parse_allocation("rollout:2+train:1").engine is None
    RLConfig(allocation="rollout:1+train:1").validate()  # the plain spelling: either back end's layout
    RLConfig(allocation="rollout:1+train:1", rollout_backend="vllm").validate()
    RLConfig(allocation="vllm:d1+d1", rollout_backend="vllm").validate()  # asynchronous GRPO on vLLM rollout ranks


def test_engine_refuses_sleep_mode_off_cuda_before_importing_vllm():
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=r"^rl\.vllm\.sleep_mode: vLLM's sleep mode needs CUDA"):
        VLLMRolloutEngine("unused", VLLMConfig(sleep_mode=True), dtype=torch.float32, device="cpu", max_model_len=64)


@pytest.mark.parametrize("device,cfg,want", [
    ("cpu", VLLMConfig(gpu_memory_utilization=0.3), r"^rl\.vllm\.gpu_memory_utilization: read on CUDA only"),
    ("cuda", VLLMConfig(cpu_kv_cache_gib=4.0), r"^rl\.vllm\.cpu_kv_cache_gib: read by vLLM's CPU build only"),
])
def test_the_other_devices_memory_key_is_refused_before_importing_vllm(device, cfg, want):
    """The engine sizes its KV cache from gpu_memory_utilization on CUDA and from cpu_kv_cache_gib on the CPU: the
    other key, set, would do nothing (exit 2 naming it, as sleep_mode off CUDA)."""
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=want):
        VLLMRolloutEngine("unused", cfg, dtype=torch.float32, device=device, max_model_len=64)
    assert VLLMConfig().device_blocker("cpu") is None and VLLMConfig().device_blocker("cuda") is None
    assert VLLMConfig(cpu_kv_cache_gib=4.0).device_blocker("cpu") is None
    assert VLLMConfig(gpu_memory_utilization=0.3).device_blocker("cuda") is None


def test_launcher_check_exits_2_naming_the_key(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(f'[model]\npath = "{tmp_path / "m"}"\nsynthesize = "tiny_qwen2_5_vl"\n\n'
                    f'[data]\ntype = "synthetic_vqa"\nsynthetic_dir = "{tmp_path / "d"}"\nmax_tokens_per_pack = 256\n\n'
                    f'[train]\nmode = "grpo"\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 1\n\n'
                    '[rl]\nallocation = "vllm:d1+d1"\n\n[rl.batch]\ngroup_size = 2\nprompts_per_step = 2\n\n'
                    '[rl.rollout]\nmax_new_tokens = 8\n')
    cmd = [sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(toml), "--check", "--device-memory-gib", "80"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "rl.allocation: 'vllm:d1+d1' puts the rollout ranks on vLLM" in lines[0], r.stderr


@pytest.mark.parametrize("allocation", [None, "vllm:d1+d1"])
def test_max_model_len_below_the_pack_is_refused_by_the_config(allocation):
    """A vLLM engine shorter than a pack caps completions at its max_model_len (finish "length", silently: measured,
    prompt 8 + max_new_tokens 100 at max_model_len 64 gave 56 tokens); the config refuses it, so `--check` and the
    asynchronous rollout ranks (which build their engine without the synchronous job's helper) do too."""
    demo = REPO / "launch" / "configs" / "demo_grpo.toml"
    sets = ['rl.rollout_backend="vllm"', "data.max_tokens_per_pack=1024"] + \
        ([f'rl.allocation="{allocation}"'] if allocation else [])
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.max_model_len: 512 is below data\.max_tokens_per_pack = 1024"):
        load_config(demo, [*sets, "rl.vllm.max_model_len=512"])
    assert load_config(demo, [*sets, "rl.vllm.max_model_len=1024"]).rl.vllm.max_model_len == 1024


def test_engine_refuses_max_model_len_below_the_pack_before_importing_vllm():
    from types import SimpleNamespace as NS

    from megatron_vlm.inference.vllm_engine import vllm_engine_for_run

    cfg = NS(rl=NS(vllm=VLLMConfig(max_model_len=512), rollout_backend="vllm", allocation=None),
             parallel=NS(tp=1, cp=1, ep=1, pp=1), data=NS(max_tokens_per_pack=1024), model=NS(path="unused"),
             train=NS(seed=0))
    ctx = NS(cfg=cfg, env=NS(world_size=1, device=torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.max_model_len: 512 is below data\.max_tokens_per_pack = 1024"):
        vllm_engine_for_run(ctx, NS(), dtype=torch.float32)
    cfg.rl.vllm = VLLMConfig(tensor_parallel_size=2)  # a layout the engine cannot run: refused first
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.tensor_parallel_size: 2: the vLLM engine shards over the "
                                          r"trainer's tensor-parallel group .* parallel\.tp = 1"):
        vllm_engine_for_run(ctx, NS(), dtype=torch.float32)


@pytest.mark.parametrize("parallel,vllm,world,allocation,want", [
    ({}, {}, 1, None, None),
    ({}, {}, 4, None, None),  # one engine per rank
    ({"tp": 2}, {"tensor_parallel_size": 2}, 4, None, None),  # the engine shards over the trainer's tp groups
    ({"tp": 2}, {}, 4, None, "rl.vllm.tensor_parallel_size"),
    ({}, {"tensor_parallel_size": 2}, 2, None, "rl.vllm.tensor_parallel_size"),
    ({}, {"tensor_parallel_size": 2}, 1, None, "rl.vllm.tensor_parallel_size"),
    ({"tp": 2}, {"tensor_parallel_size": 2}, 3, None, "rl.vllm.tensor_parallel_size"),
    ({"cp": 2}, {}, 2, None, "parallel.cp"),
    ({"ep": 2}, {}, 2, None, "parallel.ep"),
    ({"pp": 2}, {}, 2, None, "parallel.pp"),
    ({}, {"tensor_parallel_size": 2}, 2, "vllm:d1+d1", "rl.vllm.tensor_parallel_size"),
    ({}, {}, 2, "vllm:d1+d1", None),
])
def test_vllm_layout_refusals_name_the_key(parallel, vllm, world, allocation, want):
    from types import SimpleNamespace as NS

    from megatron_vlm.inference.vllm_layout import vllm_executor, vllm_layout_refusal

    cfg = NS(rl=NS(rollout_backend="vllm", vllm=VLLMConfig(**vllm), allocation=allocation),
             parallel=NS(**{"tp": 1, "cp": 1, "ep": 1, "pp": 1, **parallel}))
    got = vllm_layout_refusal(cfg, world)
    assert (got[0] if got else None) == want, got
    cfg.rl.rollout_backend = "builtin"
    assert vllm_layout_refusal(cfg, world) is None
    assert vllm_executor(world) == ("uni" if world == 1 else "external_launcher")


class _RecordingLLM:
    """Stands in for `vllm.LLM`: records the engine arguments (no vllm here)."""

    made: list = []

    def __init__(self, **kwargs):
        _RecordingLLM.made.append(kwargs)

    def collective_rpc(self, fn, args=()):
        return [0]


def test_cpu_kv_cache_gib_is_what_the_engine_gets(monkeypatch):
    """The CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE when the engine starts: the key sets it even when
    the shell (or an earlier engine of the process) already did, rounded up to whole GiB."""
    import os
    import types

    from megatron_vlm.inference import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_RecordingLLM))
    monkeypatch.setattr(vllm_engine, "vllm_importable", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    for gib, want in ((3.0, "3"), (0.5, "1")):
        vllm_engine.VLLMRolloutEngine("unused", VLLMConfig(cpu_kv_cache_gib=gib), dtype=torch.float32, device="cpu",
                                      max_model_len=256)
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == want
