"""The `--check` planner: the memory formulas on a small hand-computed case, the per-layer
activation and KV counts of toy modules, and `--check` on EVERY example config in launch/configs/
(meta device, no weights; device memory 80 GiB) with a config-only folder of the architecture it
trains (`ARCH` below: a config without a row fails, so a new example config must be added there):
the shipped configs plan within it, and the GRPO config without a rollout budget fails naming
rl.rollout.memory_gib. The real architectures' config.json dicts: tests/fixtures/real_configs.py
(written from memory; their parameter counts are asserted to be plausible)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_vlm.config import load_config
from megatron_vlm.inference.kv_budget import kv_elements_per_slot
from megatron_vlm.models import build_model
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.registry import get_family
from megatron_vlm.plan.check import run_check
from megatron_vlm.plan.memory import ModelShape, _layer_activation_elements, estimate_memory
from tests.fixtures.real_configs import PARAMS_B, REAL_CONFIGS, real_config, write_real_model_folder
from tests.unit.models.test_qwen2_5_vl_args import HUB_3B

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"


def test_memory_formulas_by_hand():
    shape = ModelShape(params=1000, trainable=600, largest_block=100, layers=4, hidden=8, act_per_token_layer=50,
                       kv_per_slot=16)
    m = estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10, activation_checkpointing=False,
                        rollout_prompts=3, group_size=2)
    assert m.params == 1000 * 4 / 2 == 2000
    assert m.grads == 600 * 4 / 2 == 1200
    assert m.optimizer == 600 * 2 * 4 / 2 == 2400
    assert m.gathered == 2 * 100 * 2 == 400
    assert m.activations_no_ckpt == 10 * 4 * 50 * 2 == 4000 == m.activations
    assert m.activations_ckpt == 10 * 4 * 8 * 2 + 10 * 50 * 2 == 1640
    assert m.kv_cache == 16 * 2 * 3 * 2 * 10 == 1920
    assert m.peak == 2000 + 1200 + 2400 + 400 + max(4000, 1920)
    ck = estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10, activation_checkpointing=True)
    assert ck.activations == 1640 and ck.kv_cache == 0 and ck.peak == 6000 + 1640
    assert estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10,
                           activation_checkpointing="full").activations == 1640
    sel = estimate_memory(shape, fsdp=2, master_bytes=4, compute_bytes=2, tokens=10, activation_checkpointing="selective")
    assert sel.activations == sel.activations_selective == m.activations_selective == 10 * 4 * (50 / 2 + 8) * 2 == 2640


def test_layer_activation_and_kv_counts():
    layer = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    assert _layer_activation_elements(layer, hidden=8) == 2 * 8 + 2 * (12 + 8)
    model = nn.Module()
    model.language_model = nn.ModuleList([Attention(16, 4, 2, 4, qkv_bias=False), Attention(16, 4, 2, 4, qkv_bias=False)])
    model.vision = Attention(16, 4, 4, 4, qkv_bias=False)  # outside the decoder: no KV cache
    assert kv_elements_per_slot(model) == 2 * (2 * 2 * 4)


def _check(config: Path, overrides: list[str], world: int) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_check(load_config(config, overrides), world_size=world, device_memory_gib=80.0, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def qwen2_5_vl_3b(tmp_path_factory) -> Path:
    """A config-only Qwen2.5-VL-3B-Instruct folder (the published config.json, no weights)."""
    d = tmp_path_factory.mktemp("qwen2_5_vl_3b")
    (d / "config.json").write_text(json.dumps(HUB_3B))
    return d


# config -> (architecture, ranks of its launch line). Architecture: a tests/fixtures/real_configs.py
# name, "qwen2_5_vl_3b" (the published HUB_3B config.json), or "synth:<name>" for a demo's tiny
# model (`model.synthesize`; the GRPO demos start from their SFT demo's export, the same tiny model).
ARCH = {
    "qwen2_5_vl_3b_geometry3k_grpo.toml": ("qwen2_5_vl_3b", 8),
    "qwen2_5_vl_3b_geometry3k_grpo_cp2.toml": ("qwen2_5_vl_3b", 8),
    "qwen2_5_vl_3b_virl39k_grpo.toml": ("qwen2_5_vl_3b", 48),
    "qwen3_vl_2b_geometry3k_grpo.toml": ("qwen3_vl_2b", 8),
    "internvl3_8b_robovqa_stage1.toml": ("internvl3_8b", 8),
    "internvl3_8b_robovqa_stage2.toml": ("internvl3_8b", 8),  # stage 1's export: transformers' layout
    "internvl3_8b_robovqa_curriculum.toml": ("internvl3_8b", 8),
    "nemotron_3_nano_vl_sft.toml": ("nemotron_3_nano_vl", 8),
    "nemotron_3_nano_vl_sft_ep8_tp2.toml": ("nemotron_3_nano_vl", 16),
    "internvl3_8b_sft_tp2.toml": ("internvl3_8b", 8),
    "qwen2_5_math_1_5b_grpo.toml": ("qwen2_5_math_1_5b", 2),
    "qwen2_5_math_1_5b_dapo.toml": ("qwen2_5_math_1_5b", 2),
    "qwen2_5_math_1_5b_reinforce_pp.toml": ("qwen2_5_math_1_5b", 2),
    "qwen2_5_math_1_5b_grpo_vllm.toml": ("qwen2_5_math_1_5b", 1),  # the vLLM back end: one process
    "qwen2_5_vl_3b_geometry3k_grpo_vllm.toml": ("qwen2_5_vl_3b", 1),
    "qwen2_5_vl_3b_virl39k_grpo_vllm.toml": ("qwen2_5_vl_3b", 1),
    "qwen2_5_vl_3b_geometry3k_dapo.toml": ("qwen2_5_vl_3b", 8),
    "qwen3_vl_30b_a3b_geometry3k_gspo.toml": ("qwen3_vl_30b_a3b", 16),
    "nemotron_3_nano_vl_geometry3k_gspo.toml": ("nemotron_3_nano_vl", 16),
    "demo_sft.toml": ("synth:", 2),
    "demo_dpo.toml": ("synth:", 2),
    "demo_reward_model.toml": ("synth:", 2),
    "demo_grpo.toml": ("synth:tiny_qwen2_5_vl", 2),
    "demo_grpo_async.toml": ("synth:tiny_qwen2_5_vl", 2),
    "demo_ppo.toml": ("synth:tiny_qwen2_5_vl", 2),
    "demo_grpo_reward_model.toml": ("synth:tiny_qwen2_5_vl", 2),
    "demo_qwen3_vl.toml": ("synth:", 2),
    "demo_internvl.toml": ("synth:", 2),
    "demo_nemotron_vl.toml": ("synth:", 2),
    "demo_nemotron_qwen3_vision.toml": ("synth:", 2),
    "demo_math_sft.toml": ("synth:", 2),
    "demo_math_grpo.toml": ("synth:tiny_qwen2", 2),
    "demo_internvl_video.toml": ("synth:", 2),
    "demo_calculator_sft.toml": ("synth:", 1),
    "demo_calculator_sft_no_tool.toml": ("synth:", 1),
    "demo_calculator_grpo.toml": ("synth:tiny_qwen2", 1),
    "demo_calculator_grpo_no_tool.toml": ("synth:tiny_qwen2", 1),
    "demo_zoom_sft.toml": ("synth:", 1),
    "demo_zoom_sft_no_tool.toml": ("synth:", 1),
    "demo_zoom_grpo.toml": ("synth:tiny_qwen2_5_vl", 1),
    "demo_zoom_grpo_no_tool.toml": ("synth:tiny_qwen2_5_vl", 1),
}
EXAMPLES = sorted(p.name for p in CONFIGS.glob("*.toml"))
# total parameters (billions) --check must print for the published Qwen2.5-VL-3B config.json
PARAMS_B_ALL = {**PARAMS_B, "qwen2_5_vl_3b": (3.7, 3.8)}


def test_every_arch_row_names_an_example_config():
    assert sorted(ARCH) == EXAMPLES, "ARCH rows and launch/configs/*.toml differ"


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory, qwen2_5_vl_3b) -> dict[str, Path]:
    """Config-only folders of every real architecture, by name."""
    root = tmp_path_factory.mktemp("real_models")
    return {"qwen2_5_vl_3b": qwen2_5_vl_3b, **{n: write_real_model_folder(n, root / n) for n in REAL_CONFIGS}}


@pytest.mark.parametrize("name", EXAMPLES)
def test_check_every_example_config(name, model_folders, tmp_path):
    assert name in ARCH, (f"launch/configs/{name} has no architecture in ARCH (tests/unit/plan/test_check_plan.py): "
                          "add its row, and a config-only fixture in tests/fixtures/real_configs.py if it is new")
    arch, world = ARCH[name]
    if arch.startswith("synth:"):
        sets = [f'model.path="{tmp_path / "m"}"'] + ([f'model.synthesize="{arch[6:]}"'] if arch[6:] else [])
    else:
        sets = [f'model.path="{model_folders[arch]}"']
    code, out, err = _check(CONFIGS / name, sets, world)
    assert code == 0, out + err
    assert out.startswith(f"check ok: {load_config(CONFIGS / name).train.mode} run, {world} ranks") and "peak" in out
    if not arch.startswith("synth:"):
        params = float(re.search(r"([0-9.]+) B parameters", out).group(1))
        lo, hi = PARAMS_B_ALL[arch]
        assert lo <= params <= hi, f"{arch}: {params} B parameters, expected {lo}..{hi}"


def _active_params(model: nn.Module) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    total = sum(p.numel() for p in model.parameters())
    for moe in moe_layers(model):
        experts = sum(p.numel() for p in moe.experts.parameters())
        total -= experts - experts * moe.gate.top_k // moe.gate.num_experts
    return total


# (architecture, model_type, active parameters in billions: inclusive range)
FIXTURES = [("qwen3_vl_2b", "qwen3_vl", (2.0, 2.3)), ("qwen3_vl_30b_a3b", "qwen3_vl_moe", (3.0, 4.0)),
            ("internvl3_8b", "internvl", (7.8, 8.1)), ("qwen2_5_math_1_5b", "qwen2", (1.5, 1.6)),
            ("nemotron_3_nano_vl", "nemotron_h_omni", (3.0, 5.0))]


def test_fixture_table_is_complete():
    assert sorted(f[0] for f in FIXTURES) == sorted(REAL_CONFIGS)


@pytest.mark.parametrize("arch, model_type, active_b", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_real_config_fixtures_parse_with_plausible_sizes(arch, model_type, active_b):
    cfg = real_config(arch)
    assert cfg["model_type"] == model_type
    get_family(model_type).args_cls.from_hf_config(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    total, active = sum(p.numel() for p in model.parameters()) / 1e9, _active_params(model) / 1e9
    lo, hi = PARAMS_B[arch]
    assert lo <= total <= hi, f"{arch}: {total:.3f} B parameters, expected {lo}..{hi}"
    assert active_b[0] <= active <= active_b[1], f"{arch}: {active:.3f} B active parameters, expected {active_b}"


def test_check_grpo_without_rollout_budget_names_the_key(qwen2_5_vl_3b):
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml",
                            [f'model.path="{qwen2_5_vl_3b}"', "rl.rollout.memory_gib=0"], 8)
    assert code == 2 and err.startswith("check failed: rl.rollout.memory_gib: estimated peak") and len(err.splitlines()) == 1
    assert "(132 prompts' slots" in out  # all of a rollout rank's 132 prompts at once (528 over rl.allocation's 4 rollout ranks)


def test_check_layout_error_names_the_key(qwen2_5_vl_3b):
    code, _, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml", [f'model.path="{qwen2_5_vl_3b}"', "parallel.dp_shard=3"], 8)
    assert code == 2 and err.startswith("check failed: parallel.dp_shard:")


def test_check_accepts_rollout_cuda_graphs_on_for_moe_as_the_job_does(tmp_path, qwen2_5_vl_3b):
    """rl.rollout.cuda_graphs = "on" with MoE layers: the decode step routes graph-safely (models/common/moe_static.py),
    so neither the job nor --check refuses it (both ask inference/policy_engine.cuda_graphs_blocker)."""
    moe = write_real_model_folder("qwen3_vl_30b_a3b", tmp_path / "moe")
    sets = ['rl.rollout.weights="copy"', 'rl.rollout.cuda_graphs="on"']
    for folder in (moe, qwen2_5_vl_3b):
        code, _, err = _check(CONFIGS / "qwen3_vl_2b_geometry3k_grpo.toml", [f'model.path="{folder}"', *sets], 8)
        assert "cuda_graphs" not in err, err


def test_check_refuses_image_questions_for_a_text_only_model(tmp_path):
    """A text-only model on the synthetic VQA set: every record is an image placeholder mismatch, so the job
    exits 2 ("no usable samples"); --check used to say ok. Checked on every family of the demo configs."""
    for name, image_model in (("tiny_qwen3", False), ("tiny_qwen2_5_vl", True)):
        sets = [f'model.path="{tmp_path / name}"', f'model.synthesize="{name}"']
        code, _, err = _check(CONFIGS / "demo_sft.toml", sets, 1)
        if image_model:
            assert code == 0, err
        else:
            assert code == 2 and err.startswith("check failed: data.type: 'synthetic_vqa' asks questions about images, "
                                                "and 'qwen3' is a text-only model"), err


def test_check_runs_the_mcore_backend_refusals(tmp_path):
    """parallel.backend = "mcore" with [lora] on Nemotron-VL: the megatron-core hybrid blocks take no adapters, so
    the job exits 2 (models/mcore/layer.py check_mcore_model); --check used to say ok. Native: accepted."""
    sets = [f'model.path="{tmp_path / "m"}"', 'model.synthesize="tiny_nemotron_vl"', "train.train_layers=[]", "lora.r=4"]
    code, _, err = _check(CONFIGS / "demo_sft.toml", sets, 1)
    assert code == 0, err
    code, _, err = _check(CONFIGS / "demo_sft.toml", [*sets, 'parallel.backend="mcore"'], 1)
    assert code == 2 and err.startswith("check failed: lora.target_modules: adapts language_model.layers.") and \
        "parallel.backend = 'mcore' does not adapt" in err, err


def test_check_plans_the_vllm_engine_and_refuses_what_it_cannot_run(qwen2_5_vl_3b):
    """rollout_backend = "vllm": the engine's device share is planned (rl.vllm.gpu_memory_utilization, no
    built-in KV cache); several processes run one engine each; a share that leaves no room for the trainer, an engine
    tensor-parallel size other than the trainer's, and context parallelism exit 2 naming the key."""
    cfg = CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo_vllm.toml"
    code, out, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"'], 1)
    assert code == 0, err
    assert "vllm       engine 16.00 GiB (rl.vllm.gpu_memory_utilization)" in out  # 0.2 of 80 GiB
    assert "in the vLLM engine" in out and "rollout KV cache 0.00 GiB" in out
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"', "rl.vllm.gpu_memory_utilization=1.0"], 1)
    assert code == 2 and err.startswith("check failed: rl.vllm.gpu_memory_utilization: estimated peak"), err
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"'], 2)  # one engine per rank (external launcher)
    assert code == 0, err
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"', "rl.vllm.tensor_parallel_size=2"], 2)
    assert code == 2 and err.startswith("check failed: rl.vllm.tensor_parallel_size: 2: the vLLM engine shards over the "
                                        "trainer's tensor-parallel group"), err
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"', "parallel.cp=2"], 2)
    assert code == 2 and err.startswith("check failed: parallel.cp: 2 with rollout_backend = 'vllm'"), err


@pytest.mark.parametrize("world, memory, key", [(0, 80.0, "--world-size"), (-2, 80.0, "--world-size"),
                                                (1, 0.0, "--device-memory-gib"), (1, -1.0, "--device-memory-gib"),
                                                (1, float("nan"), "--device-memory-gib"),
                                                (1, float("inf"), "--device-memory-gib")])
def test_check_refuses_impossible_options(world, memory, key, tmp_path):
    """A zero / negative rank count or a non-positive / non-finite device memory used to print
    "check ok" with "0 ranks", "dp_shard -2" or "of nan GiB"."""
    out, err = io.StringIO(), io.StringIO()
    cfg = load_config(CONFIGS / "demo_sft.toml", [f'model.path="{tmp_path / "m"}"'])
    assert run_check(cfg, world_size=world, device_memory_gib=memory, out=out, err=err) == 2
    assert err.getvalue().startswith(f"check failed: {key}: ") and out.getvalue() == ""


@pytest.mark.parametrize("arch, pp", [("qwen2_5_math_1_5b", 4), ("qwen3_vl_2b", 2)])
def test_check_counts_one_pipeline_stage_per_rank(arch, pp, model_folders):
    """parallel.pp > 1: a rank holds one stage (the runtime split, parallel/pipeline.py, is the reference);
    the plan counted the whole model per rank (and its layout line left pp out)."""
    from megatron_vlm.parallel.pipeline import split_model_for_stage
    from megatron_vlm.training.lm_loss import TokenLogprobModel

    hf = real_config(arch)
    held = []
    for s in range(pp):
        with torch.device("meta"):
            model = build_model(hf)
        stage = split_model_for_stage(model, TokenLogprobModel, stage=s, pp=pp, max_tokens=32, act_dtype=torch.float32)
        held.append(sum(p.numel() for p in stage.parameters()))
    world, sets = 2 * pp, [f'model.path="{model_folders[arch]}"', "parallel.pp=" + str(pp), 'model.dtype="float32"',
                           'data.eval_path=""', "train.eval_every=0", f"train.micro_batches_per_step={pp}"]
    code, out, err = _check(CONFIGS / "demo_math_sft.toml", sets, world)
    assert code == 0, out + err
    assert f"x tp 1 x cp 1 x pp {pp}, ep 1" in out
    master = float(re.search(r"master weights +([0-9.]+) GiB", out).group(1))
    assert master == pytest.approx(max(held) * 4 / 2 / 2**30, abs=0.006)  # fp32 master weights over dp_shard 2


def test_check_of_an_evaluation_counts_weights_and_kv_cache_not_training_state(qwen2_5_vl_3b):
    """train.mode = "eval": the plan counted gradients, AdamW states and training activations (an evaluation
    holds none) and no KV cache for its generation, so a model that evaluates fine could be refused."""
    from megatron_vlm.config import load_config_dict

    cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "train": {"mode": "eval"},
                            "eval": {"batch_size": 16, "samples": 4,
                                     "benchmarks": [{"name": "g", "path": "/d", "format": "geometry3k"}]}})
    out, err = io.StringIO(), io.StringIO()
    assert run_check(cfg, world_size=1, device_memory_gib=80.0, out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    assert re.search(r"gradients +0\.00 GiB +AdamW +0\.00 GiB", text), text
    assert re.search(r"^  weights +[0-9.]+ GiB", text, re.M), text  # an evaluation holds no master weights
    cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "train": {"mode": "eval"},
                            "parallel": {"fsdp": False}, "eval": {"batch_size": 16, "samples": 4,
                            "benchmarks": [{"name": "g", "path": "/d", "format": "geometry3k"}]}})
    out = io.StringIO()
    assert run_check(cfg, world_size=1, device_memory_gib=80.0, out=out, err=err) == 0, err.getvalue()
    assert re.search(r"^  weights +[0-9.]+ GiB", out.getvalue(), re.M), out.getvalue()  # nor masters without FSDP2
    # Qwen2.5-VL-3B: 36 layers x 2 KV heads x head_dim 128, K and V, bf16; 16 prompts x 4 samples x 4096 slots
    kv = 2 * 36 * 2 * 128 * 2 * 16 * 4 * 4096 / 2**30
    assert f"rollout KV cache {kv:.2f} GiB" in text, text


def test_check_of_asynchronous_grpo_plans_rollout_and_training_ranks_apart(qwen2_5_vl_3b):
    """rl.allocation: a rollout rank loads the whole policy in bf16 and holds its engine's KV pool, a training rank
    the FSDP-sharded policy, gradients and AdamW states without any rollout copy or KV cache; each is checked."""
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml", [f'model.path="{qwen2_5_vl_3b}"'], 8)
    assert code == 0, err
    rollout, training = out.split("memory per rollout rank")[1].split("memory per training rank")
    params = sum(p.numel() for p in _meta_3b().parameters())
    copy = re.search(r"policy copy ([\d.]+) GiB", rollout)
    assert copy and abs(float(copy.group(1)) - params * 2 / 2**30) < 0.01  # bf16, not sharded
    kv = re.search(r"KV pool ([\d.]+) GiB", rollout)
    # 8 prompts per batch (rl.rollout.memory_gib) x group 4 x 20480 positions x 36 layers x 2 x 2 kv heads x 128 x bf16
    assert kv and abs(float(kv.group(1)) - 8 * 4 * 20480 * 36 * 2 * 2 * 128 * 2 / 2**30) < 0.01
    assert "KV cache" not in training and "rollout copy" not in training
    master = re.search(r"master weights\s+([\d.]+) GiB", training)
    assert master and abs(float(master.group(1)) - params * 4 / 4 / 2**30) < 0.01  # fp32 over the 4 training ranks
    # a rollout rank that cannot hold its batch names the key that sizes it
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml",
                            [f'model.path="{qwen2_5_vl_3b}"', "rl.rollout.batch_prompts=132", "rl.rollout.memory_gib=0"], 8)
    assert code == 2 and err.startswith("check failed: rl.rollout.batch_prompts: estimated peak") and "per rollout rank" in err


def _meta_3b() -> nn.Module:
    with torch.device("meta"):
        return build_model(HUB_3B)


def test_check_of_expert_parallelism_on_a_dense_model_says_it_has_no_moe_blocks(qwen2_5_vl_3b):
    code, _, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml",
                          [f'model.path="{qwen2_5_vl_3b}"', "parallel.ep=2"], 8)
    assert code == 2 and err.startswith("check failed: parallel.ep: 2: the model has no MoE blocks"), err


def test_check_says_when_an_own_rollout_copy_fits_instead_of_shared_weights(qwen2_5_vl_3b):
    """rl.rollout.weights = "shared" gathers the weights at every decode step and decodes eagerly; where an own copy
    fits next to the rest, --check says so with the peak it would have (the copy is the policy in bf16)."""
    sets = [f'model.path="{qwen2_5_vl_3b}"']
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml", sets + ['rl.rollout.weights="shared"'], 8)
    assert code == 0, err
    peak = float(re.search(r"  peak ([\d.]+) GiB", out).group(1))
    hint = re.search(r'hint: rl.rollout.weights = "copy" fits too \(peak ([\d.]+) GiB of 80 GiB\)', out)
    params = sum(p.numel() for p in _meta_3b().parameters())
    assert hint and abs(float(hint.group(1)) - peak - params * 2 / 2**30) < 0.02, out
    code, out, _ = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml", sets, 8)  # the recipe's own copy
    assert code == 0 and "hint:" not in out and "rl.rollout.weights = 'copy'" in out
    # no room for a copy: no hint (a 3B policy's bf16 copy is ~7 GiB)
    tight = peak + 1.0
    out_tight = io.StringIO()
    assert run_check(load_config(CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml", sets + ['rl.rollout.weights="shared"']),
                     world_size=8, device_memory_gib=tight, out=out_tight, err=io.StringIO()) == 0
    assert "hint:" not in out_tight.getvalue()


@pytest.mark.parametrize("sets,decode", [
    ([], "decode     CUDA graphs on a GPU (rl.rollout.cuda_graphs = 'auto'), eager on a CPU"),  # the recipe's copy
    (['rl.rollout.weights="shared"'], "decode     eager lock-step steps through the trainer's FSDP model"),
    (['rl.rollout.cuda_graphs="off"'], "decode     eager steps (rl.rollout.cuda_graphs = 'off')"),
])
def test_check_says_how_the_rollout_decodes(qwen2_5_vl_3b, sets, decode):
    """The decode step's form decides its speed on a GPU several-fold (eager steps are host-bound): --check names it
    and what chose it."""
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml", [f'model.path="{qwen2_5_vl_3b}"', *sets], 8)
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("decode")] == [line for line in out.splitlines()
                                                                                 if line.startswith(decode)], out
    assert any(line.startswith(decode) for line in out.splitlines()), out


def test_check_of_asynchronous_rollout_ranks_says_they_decode_in_graphs(qwen2_5_vl_3b):
    code, out, err = _check(CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml", [f'model.path="{qwen2_5_vl_3b}"'], 8)
    assert code == 0 and "decode     CUDA graphs on a GPU (rl.rollout.cuda_graphs = 'auto')" in out, out + err


def _plan_sft(model: Path, **train) -> tuple[int, str, str]:
    from megatron_vlm.config import load_config_dict

    tokens = train.pop("tokens")
    cfg = load_config_dict({"model": {"path": str(model)}, "train": {"mode": "sft", "max_steps": 1, **train},
                            "data": {"train_path": "/d/train.jsonl", "max_tokens_per_pack": tokens}})
    out, err = io.StringIO(), io.StringIO()
    code = run_check(cfg, world_size=1, device_memory_gib=80.0, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_check_plans_selective_checkpointing(qwen2_5_vl_3b):
    """train.activation_checkpointing = "selective" is planned as what it keeps (between whole-block checkpointing
    and none), and the plan names what to change when it does not fit: whole-block checkpointing."""
    code, out, err = _plan_sft(qwen2_5_vl_3b, activation_checkpointing="selective", tokens=8192)
    assert code == 0, out + err
    assert "activation checkpointing selective" in out
    got = re.search(r"activations ([0-9.]+) GiB \(checkpointing on ([0-9.]+) GiB, selective ([0-9.]+) GiB, off ([0-9.]+) GiB",
                    out)
    assert got, out
    act, full, sel, off = map(float, got.groups())
    assert act == sel and full < sel < off
    # Qwen2.5-VL-3B decoder: 36 layers x (a / 2 + h) elements per token, a = 2h + 2 x (q, k, v, o, gate, up, down outputs)
    a = 2 * 2048 + 2 * (2048 + 256 + 256 + 2048 + 11008 + 11008 + 2048)
    assert sel == pytest.approx(8192 * 36 * (a / 2 + 2048) * 2 / 2**30, abs=0.006)
    # at 32k tokens the kept outputs outweigh the weights and optimizer: whole-block checkpointing is the key to change
    code, out, err = _plan_sft(qwen2_5_vl_3b, activation_checkpointing="selective", tokens=32768)
    assert code == 2 and err.startswith("check failed: train.activation_checkpointing: estimated peak"), err


def test_check_counts_bf16_moments_at_two_bytes(qwen2_5_vl_3b):
    """optimizer.moments_dtype = "bf16": the AdamW line is half the fp32 one (2 x 2 instead of 2 x 4 bytes per trainable
    parameter), the master weights and gradients unchanged: the 16k-token selective step at the 3B shape then fits an
    80 GB card, and its fp32 refusal names optimizer.moments_dtype."""
    from megatron_vlm.config import load_config_dict

    lines = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "optimizer": {"moments_dtype": dtype},
                                "train": {"max_steps": 1, "activation_checkpointing": "selective"},
                                "data": {"type": "synthetic_vqa", "max_tokens_per_pack": 16384}})
        out, err = io.StringIO(), io.StringIO()
        code = run_check(cfg, world_size=1, device_memory_gib=79.2, out=out, err=err)  # an 80 GB H100
        assert code == (2 if dtype == "fp32" else 0), err.getvalue()
        if dtype == "fp32":  # the refusal names the key that is enough on one rank
            assert "check failed: optimizer.moments_dtype: " in err.getvalue(), err.getvalue()
        text = out.getvalue()
        lines[dtype] = [float(re.search(rf"{k} +([0-9.]+) GiB", text).group(1)) for k in ("master weights", "gradients", "AdamW")]
    (w32, g32, a32), (w16, g16, a16) = lines["fp32"], lines["bf16"]
    assert (w16, g16) == (w32, g32) and a32 > 10 and a16 == pytest.approx(a32 / 2, abs=0.01), lines


def test_check_counts_no_fsdp_weights_beside_their_masters(qwen2_5_vl_3b):
    """parallel.fsdp = false in bf16: the bf16 weights of every parameter (2 bytes) plus the fp32 masters of the
    trainable ones (4 bytes) instead of FSDP2's fp32 weights, and no gathered block; gradients and AdamW unchanged."""
    from megatron_vlm.config import load_config_dict

    got = {}
    for fsdp in ("auto", False):
        cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "parallel": {"fsdp": fsdp},
                                "train": {"max_steps": 1, "precision": "bf16", "train_layers": ["^language_model\\."]},
                                "data": {"type": "synthetic_vqa", "max_tokens_per_pack": 4096}})
        out = io.StringIO()
        assert run_check(cfg, world_size=1, device_memory_gib=141.0, out=out, err=io.StringIO()) == 0
        text = out.getvalue()
        got[fsdp] = [float(re.search(rf"{k} +([0-9.]+) GiB", text).group(1))
                     for k in ("weights\\+masters" if fsdp is False else "master weights", "gradients", "AdamW", "gathered block")]
    (w, g, a, gathered), (w0, g0, a0, gathered0) = got["auto"], got[False]
    # P x 4 (FSDP2) against P x 2 + T x 4, T the trainable share (gradients: T x 4)
    assert w0 == pytest.approx(w / 2 + g, abs=0.02) and w0 > w and (g0, a0) == (g, a), got
    assert gathered > 0 and gathered0 == 0


def test_no_fsdp_refused_with_parallel_layouts():
    from megatron_vlm.config import load_config_dict

    for key, value in (("tp", 2), ("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("backend", "mcore"),
                       ("reshard_after_forward", False)):
        with pytest.raises(ValueError, match="fsdp: false|fsdp = false"):
            load_config_dict({"parallel": {"fsdp": False, key: value}, "train": {"max_steps": 1},
                              "data": {"type": "synthetic_vqa"}})


def test_check_refuses_no_fsdp_on_more_than_one_rank(qwen2_5_vl_3b):
    """parallel.fsdp = false runs one process (the run exits 2 naming the key with more): --check says so too, for
    the training ranks (an asynchronous GRPO run's rollout ranks excepted), instead of planning "dp_shard 2"."""
    from megatron_vlm.config import load_config_dict

    cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "parallel": {"fsdp": False},
                            "train": {"max_steps": 1, "precision": "bf16"}, "data": {"type": "synthetic_vqa"}})
    err = io.StringIO()
    assert run_check(cfg, world_size=2, device_memory_gib=141.0, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("check failed: parallel.fsdp: false runs one process"), err.getvalue()
    assert run_check(cfg, world_size=1, device_memory_gib=141.0, out=io.StringIO(), err=io.StringIO()) == 0


def test_check_of_no_fsdp_shared_rollout_says_it_decodes_in_place_without_a_copy_hint(qwen2_5_vl_3b):
    """parallel.fsdp = false with rl.rollout.weights = "shared": the engine decodes with the trainer's own bf16 weights
    (nothing gathered, continuous batching, CUDA graphs on a GPU), so the plan must not say that the weights are
    gathered at every step in eager lock-step, nor advise an own copy, which would add a whole bf16 model for nothing."""
    sets = [f'model.path="{qwen2_5_vl_3b}"', 'rl.rollout.weights="shared"', "parallel.fsdp=false"]

    def check(extra: list[str]) -> tuple[int, str, str]:  # one H200: room for a copy, so a hint would be given
        out, err = io.StringIO(), io.StringIO()
        code = run_check(load_config(CONFIGS / "qwen2_5_vl_3b_geometry3k_dapo.toml", sets + extra), world_size=1,
                         device_memory_gib=141.0, out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    code, out, err = check([])
    assert code == 0, err
    assert "hint:" not in out and "lock-step" not in out and "all-gathered" not in out, out
    assert "decode     CUDA graphs on a GPU (rl.rollout.cuda_graphs = 'auto'), eager on a CPU" in out, out
    # in full precision there are no bf16 weights to decode with in place: the engine calls the model in lock-step
    code, out, err = check(['train.precision="fp32"'])
    assert code == 0 and "decode     eager lock-step steps" in out, out + err


def test_check_of_no_fsdp_over_memory_names_parallel_fsdp_not_dp_shard(qwen2_5_vl_3b):
    """A parallel.fsdp = false run whose weights and optimizer states do not fit names parallel.fsdp: dp_shard (the
    key an FSDP2 run is told to raise) is refused beside fsdp = false, and FSDP2 also drops the bf16 weight copy."""
    from megatron_vlm.config import load_config_dict

    cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b)}, "parallel": {"fsdp": False},
                            "optimizer": {"moments_dtype": "bf16"},
                            "train": {"max_steps": 1, "precision": "bf16", "activation_checkpointing": True},
                            "data": {"type": "synthetic_vqa", "max_tokens_per_pack": 1024}})
    err = io.StringIO()
    assert run_check(cfg, world_size=1, device_memory_gib=40.0, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("check failed: parallel.fsdp: estimated peak"), err.getvalue()


def test_check_of_bf16_weights_in_full_precision_plans_bf16_activations(qwen2_5_vl_3b):
    """model.dtype = "bfloat16" with train.precision = "fp32": nothing is cast (no mixed precision), so the forward
    computes in the weights' bf16 (parallel/precision.py `compute_dtype`): activations and the rollout's KV cache take
    2 bytes per element, as under bf16 precision, not the 4 of fp32 weights."""
    from megatron_vlm.config import load_config_dict

    def activations(precision: str) -> float:
        cfg = load_config_dict({"model": {"path": str(qwen2_5_vl_3b), "dtype": "bfloat16"},
                                "train": {"max_steps": 1, "precision": precision},
                                "data": {"type": "synthetic_vqa", "max_tokens_per_pack": 4096}})
        out = io.StringIO()
        assert run_check(cfg, world_size=1, device_memory_gib=1000.0, out=out, err=io.StringIO()) == 0
        return float(re.search(r"activations ([0-9.]+) GiB", out.getvalue()).group(1))

    assert activations("fp32") == activations("bf16")


def test_check_of_a_grpo_run_without_its_model_folder_says_how_to_make_it(tmp_path):
    """The run says `rl.model_path_hint` when the GRPO start folder is missing (rl/trainer.py); --check said only
    that config.json does not exist, so a user checking the GRPO demo first was not told to run its SFT."""
    code, _, err = _check(CONFIGS / "demo_grpo.toml", [f'model.path="{tmp_path / "none"}"',
                                                        'rl.model_path_hint="run the SFT demo first"'], 1)
    assert code == 2 and err.startswith("check failed: model.path: ") and err.rstrip().endswith(
        "; run the SFT demo first"), err


def test_check_refuses_sync_grpo_with_fewer_prompts_than_data_parallel_ranks(qwen2_5_vl_3b):
    """8 ranks / parallel.cp 2 = 4 data-parallel ranks: 3 prompts per step would idle one at every step (the job's
    own refusal, rl/config.py data_shards_refusal, found here before any rank starts); 4 plan."""
    cfg = CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo_cp2.toml"
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"', "rl.batch.prompts_per_step=3"], 8)
    assert code == 2 and err.startswith("check failed: rl.batch.prompts_per_step: 3 prompts per step for 4 "
                                        "data-parallel ranks"), err
    code, _, err = _check(cfg, [f'model.path="{qwen2_5_vl_3b}"', "rl.batch.prompts_per_step=4"], 8)
    assert code == 0, err
