"""`rl.rollout.kv_block_size` / `rl.rollout.kv_cache_blocks`: the config keys of the rollout engine's paged KV cache.

- the keys validate (0 = slot cache; >= 2 positions per block; a pool only with a block size, only with
  continuous batching, large enough for one sample of a full pack) and each refusal names its key;
- a Mamba2 hybrid decoder (Nemotron-VL) is refused: by the engine (`PagedKVConfigError`, exit 2) and `--check`,
  and the launcher's `--check` on a tiny TOML exits 2 with one line naming the key (CUDA-graph decode, "on",
  is accepted: static steps run on the pool, tests/unit/rl/test_rollout_paged_on_demand.py);
- the GRPO engine builder hands both keys to the engine (both weight modes);
- lock-step batches (the "shared" weights mode) on the paged cache, a dummy row on the scratch slot
  while "another rank" still decodes, give the slot cache's tokens and log-probs.
The whole-job comparison is tests/integration/test_grpo_paged_kv.py."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PagedKVConfigError, PolicyRolloutEngine, paged_kv_blocker
from megatron_vlm.models import build_model
from megatron_vlm.models.common.slot_cache import PagedSlotCache
from megatron_vlm.plan.check import run_check
from megatron_vlm.rl.config import MOVED_KEYS, RLConfig
from megatron_vlm.rl.trainer import build_rollout_engine
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_tokenizer, tiny_nemotron_vl_hf_config
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.rl_config import rl_config
from tests.fixtures.rollout_engine import make_engine
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]
DEMO_GRPO = REPO / "launch" / "configs" / "demo_grpo.toml"


def test_defaults_and_valid_values():
    rl = RLConfig()
    rl.validate()
    assert rl.rollout.kv_block_size == 0 and rl.rollout.kv_cache_blocks == 0  # the slot cache, as before the key existed
    rl_config(kv_block_size=2).validate()
    rl_config(kv_block_size=16, rollout_cuda_graphs="auto").validate()
    rl_config(kv_block_size=4, rollout_weights="copy", rollout_cuda_graphs="on").validate()  # static steps on the pool
    rl_config(kv_block_size=4, allocation="rollout:1+train:1", rollout_cuda_graphs="on").validate()
    rl_config(kv_block_size=16, kv_cache_blocks=64, rollout_weights="copy").validate()
    rl_config(kv_block_size=16, kv_cache_blocks=64, allocation="rollout:1+train:1", rollout_weights="copy").validate()
    rl_config(kv_block_size=4, kv_cache_blocks=8).validate()  # lock-step ("shared"): admitted as blocks come back


@pytest.mark.parametrize("kwargs, key, why", [
    (dict(kv_block_size=-1), "rollout.kv_block_size", "must be 0 (the slot cache) or >= 2"),
    (dict(kv_block_size=1), "rollout.kv_block_size", "must be 0 (the slot cache) or >= 2"),
    (dict(kv_cache_blocks=-1, kv_block_size=4), "rollout.kv_cache_blocks", "must be >= 0"),
    (dict(kv_cache_blocks=8, rollout_weights="copy"), "rollout.kv_cache_blocks", "8 sizes the paged KV cache, which is off"),
])
def test_refusals_name_the_key(kwargs, key, why):
    with pytest.raises(ValueError) as e:
        rl_config(**kwargs).validate()
    assert str(e.value).startswith(key + ":") and why in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=rf"^rl\.{key}: "):  # through the loader: the dotted key (exit 2)
        load_config(DEMO_GRPO, [f"rl.{MOVED_KEYS.get(k, k)}={v!r}".replace("'", '"') for k, v in kwargs.items()])


def test_pool_must_hold_one_sample_of_a_full_pack():
    base = ['rl.rollout.weights="copy"', "rl.rollout.kv_block_size=16", "data.max_tokens_per_pack=1024"]
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.kv_cache_blocks: 64 blocks of 16 positions cannot hold one sample of "
                                          r"up to data\.max_tokens_per_pack = 1024 tokens .*needs >= 65"):
        load_config(DEMO_GRPO, [*base, "rl.rollout.kv_cache_blocks=64"])
    assert load_config(DEMO_GRPO, [*base, "rl.rollout.kv_cache_blocks=65"]).rl.rollout.kv_cache_blocks == 65


def _tiny_qwen():
    torch.manual_seed(0)
    return build_model(F.tiny_qwen2_5_vl_config_dict()).eval()


def _tiny_nemotron():
    torch.manual_seed(0)
    return build_model(tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer())).eval()


class Tok:
    pad_token_id = F.PAD_TOKEN_ID
    eos_token_id = 2  # the builder's engines find it here; the generating test passes its own (none)

    def decode(self, ids, skip_special_tokens=False):
        return ""


def test_engine_refuses_a_mamba2_hybrid_decoder():
    hybrid = _tiny_nemotron()
    why = paged_kv_blocker(hybrid)
    assert why and "Mamba2" in why and paged_kv_blocker(_tiny_qwen()) is None
    with pytest.raises(PagedKVConfigError, match=r"^rl\.rollout\.kv_block_size: 4 \(the paged KV cache\) is not possible: .*Mamba2"):
        PolicyRolloutEngine(hybrid, Tok(), EngineOptions(kv_block_size=4))
    PolicyRolloutEngine(hybrid, Tok())  # the slot cache: fine
    with torch.device("meta"):  # --check asks a meta-device model: same answer
        assert paged_kv_blocker(build_model(tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer()))) == why


@pytest.mark.parametrize("weights", ["shared", "copy"])
def test_grpo_engine_builder_passes_the_keys(weights, monkeypatch, tmp_path):
    model = _tiny_qwen()
    monkeypatch.setattr("megatron_vlm.checkpoint.hf.load_hf_model", lambda *a, **k: _tiny_qwen())
    bundle = NS(model=model, processor=NS(tokenizer=Tok()), wrapper=lambda model_kwargs: model(**model_kwargs))
    rl = rl_config(kv_block_size=4, kv_cache_blocks=40 if weights == "copy" else 0, rollout_weights=weights, group_size=2)
    rl.validate()
    engine = build_rollout_engine(rl, bundle, str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), per_batch=1)
    assert (engine.kv_block_size, engine.kv_cache_blocks, engine.lockstep) == (4, rl.rollout.kv_cache_blocks, weights == "shared")
    default = build_rollout_engine(rl_config(rollout_weights=weights), bundle, str(tmp_path), dtype=torch.float32,
                                   device=torch.device("cpu"), per_batch=1)
    assert default.kv_block_size == 0 and default.kv_cache_blocks == 0


def test_lockstep_dummy_rows_on_the_paged_cache_equal_the_slot_cache():
    model = _tiny_qwen()
    g = torch.Generator().manual_seed(7)
    prompts = []
    for parts in ([2, ("image", (1, 4, 4)), 3], [5, 1, 4]):
        s = F.build_sample(parts, g)
        prompts.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
    params = SamplingParams(max_new_tokens=5, n=2, temperature=1.0)
    used = []
    real_init = PagedSlotCache.__init__

    def spy(self, *a, **k):
        used.append(True)
        real_init(self, *a, **k)

    def run(**kw):
        extra = []

        def other_rank_busy(active: bool) -> bool:  # another rank keeps decoding 3 steps longer
            extra.append(active)
            return active or sum(not a for a in extra) <= 3

        eng = make_engine(model, Tok(), eos_token_ids=[-1], forward=model, all_ranks_active=other_rank_busy, **kw)
        return eng.generate(prompts, params, generator=torch.Generator().manual_seed(3))

    ref = run()
    PagedSlotCache.__init__ = spy
    try:
        got = run(kv_block_size=4)
    finally:
        PagedSlotCache.__init__ = real_init
    assert used and got.stats["forward_calls"] == ref.stats["forward_calls"]  # the paged cache ran the same steps
    for a, b in zip(ref.samples, got.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def _check(overrides: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(DEMO_GRPO, overrides), world_size=1, device_memory_gib=80.0, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_check_plans_the_paged_cache_and_refuses_the_hybrid(tmp_path):
    qwen = [f'model.path="{tmp_path / "qwen"}"', 'model.synthesize="tiny_qwen2_5_vl"']
    code, out, err = _check([*qwen, "rl.rollout.kv_block_size=16"])
    assert code == 0 and "kv cache   paged, 16 positions per block, pool derived" in out, err
    slots_plan = [x for x in _check(qwen)[1].splitlines() if "rollout KV cache" in x]
    assert [x for x in out.splitlines() if "rollout KV cache" in x] == slots_plan  # derived pool: the slots' memory
    code, out, err = _check([*qwen, "rl.rollout.kv_block_size=16", "rl.rollout.kv_cache_blocks=65", 'rl.rollout.weights="copy"'])
    assert code == 0 and "pool 65 blocks (rl.rollout.kv_cache_blocks)" in out, err
    assert [x for x in out.splitlines() if "rollout KV cache" in x] != slots_plan  # a fixed pool: its own size
    code, _, err = _check([*qwen, "rl.rollout.kv_block_size=16", "rl.rollout.kv_cache_blocks=400000000", 'rl.rollout.weights="copy"'])
    assert code == 2 and err.startswith("check failed: rl.rollout.kv_cache_blocks: estimated peak"), err  # the pool is what to shrink
    nemotron = [f'model.path="{tmp_path / "nemotron"}"', 'model.synthesize="tiny_nemotron_vl"', "train.train_layers=[]"]
    assert _check(nemotron)[0] == 0
    code, _, err = _check([*nemotron, "rl.rollout.kv_block_size=16"])
    assert code == 2 and err.startswith("check failed: rl.rollout.kv_block_size: 16 (the paged KV cache) is not possible: ") \
        and "Mamba2" in err and len(err.splitlines()) == 1, err


def test_launcher_check_exits_2_naming_the_key(tmp_path):
    """`launch/pretrain_vlm.py --check` on a tiny TOML: the model refusal (a hybrid decoder) and a config refusal
    (a fixed pool with lock-step batches) each exit 2 with one line naming its key; the first in a real process (all it
    prints on stderr is that line), the second run in-process."""
    toml = tmp_path / "tiny.toml"
    toml.write_text(f'[model]\npath = "{tmp_path / "m"}"\nsynthesize = "tiny_nemotron_vl"\n\n'
                    f'[data]\ntype = "synthetic_vqa"\nsynthetic_dir = "{tmp_path / "d"}"\nmax_tokens_per_pack = 256\n\n'
                    f'[train]\nmode = "grpo"\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 1\n\n'
                    '[rl.batch]\ngroup_size = 2\nprompts_per_step = 2\n\n[rl.rollout]\nmax_new_tokens = 8\nkv_block_size = 8\n')
    cmd = [sys.executable, str(REPO / "launch" / "pretrain_vlm.py"), "--config", str(toml), "--check",
           "--device-memory-gib", "80"]
    for extra, want in (([], "check failed: rl.rollout.kv_block_size: 8 (the paged KV cache) is not possible: "),
                        (["--set", "rl.rollout.kv_cache_blocks=8"],
                         "rl.rollout.kv_cache_blocks: 8 blocks of 8 positions cannot hold one sample")):
        r = (run_launcher("pretrain_vlm", [*cmd[2:], *extra]) if extra else
             subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120, cwd=str(REPO)))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], r.stderr[-2000:]
