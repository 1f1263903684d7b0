"""Config keys that a job kind would silently ignore are refused (exit 2, one line naming the dotted
key), GRPO honours `train.epochs`, a rollout batch is bounded by `rl.rollout.memory_gib`, and every
shipped example config passes these checks."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode, check_moe_section
from megatron_vlm.inference.kv_budget import rollout_prompts_for_budget
from megatron_vlm.rl.trainer import grpo_total_steps
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"
GRPO = CONFIGS / "qwen2_5_vl_3b_geometry3k_grpo.toml"
SFT = CONFIGS / "demo_sft.toml"


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_set_no_ignored_key(config):
    check_keys_for_mode(load_config(config))


@pytest.mark.parametrize("override, key", [
    ("train.micro_batches_per_step=2", "train.micro_batches_per_step"),
    ("train.eval_every=10", "train.eval_every"),
    ("train.eval_max_batches=3", "train.eval_max_batches"),
    ("train.eval_generate=false", "train.eval_generate"),
    ("data.num_workers=4", "data.num_workers"),
    ("data.prefetch_factor=4", "data.prefetch_factor"),
    ("data.shuffle=false", "data.shuffle"),
    ('data.length_cache_dir="x"', "data.length_cache_dir"),
    ("data.loader_timeout_s=600", "data.loader_timeout_s"),
])
def test_grpo_refuses_keys_it_ignores(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: has no effect when train.mode = \"grpo\""):
        check_keys_for_mode(load_config(GRPO, [override]))


def test_loader_timeout_is_checked_where_loader_workers_run():
    """`data.loader_timeout_s` bounds the wait for a DataLoader worker: refused without workers (SFT with
    num_workers = 0; GRPO above), and checked against `data.video_decode_timeout_s` only where workers run, so a
    GRPO job may raise the video decode timeout past the loader's default it never reads."""
    with pytest.raises(ConfigError, match=r"^data.loader_timeout_s: has no effect with data.num_workers = 0"):
        check_keys_for_mode(load_config(SFT, ["data.num_workers=0", "data.loader_timeout_s=600"]))
    with pytest.raises(ConfigError, match=r"^data.loader_timeout_s: 5.0 is shorter than video_decode_timeout_s"):
        check_keys_for_mode(load_config(SFT, ["data.loader_timeout_s=5"]))
    check_keys_for_mode(load_config(SFT, ["data.num_workers=0", "data.video_decode_timeout_s=4000"]))
    check_keys_for_mode(load_config(GRPO, ["data.video_decode_timeout_s=4000"]))


def test_sft_refuses_an_rl_section_and_eval_without_a_split():
    with pytest.raises(ConfigError, match=r"^rl: an \[rl\] section is only read"):
        check_keys_for_mode(load_config(SFT, ["rl.batch.group_size=4"]))
    with pytest.raises(ConfigError, match=r"^train.eval_every: there is no held-out split"):
        check_keys_for_mode(load_config(CONFIGS / "internvl3_8b_robovqa_stage1.toml", ['data.eval_path=""', "train.eval_every=5"]))


def test_moe_keys_refused_on_a_dense_model():
    from megatron_vlm.models.common.moe import MoE
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    cfg = load_config(SFT, ["moe.aux_loss_coef=0.01"])
    with pytest.raises(ConfigError, match=r"^moe.aux_loss_coef: the model \(Sequential\) has no MoE layers"):
        check_moe_section(cfg, dense)
    check_moe_section(load_config(SFT), dense)  # defaults: fine
    class BareMoE(MoE):
        def __init__(self, bias):
            torch.nn.Module.__init__(self)
            self.gate = NS(e_score_correction_bias=torch.zeros(2) if bias else None)

    check_moe_section(cfg, torch.nn.Sequential(BareMoE(bias=True)))  # a MoE model: fine
    check_moe_section(cfg, torch.nn.Sequential(BareMoE(bias=False)))  # the auxiliary loss needs no bias
    for sets in (["moe.bias_update_rate=0.01"], ["moe.enable_moe_load_balancing_training=false"]):
        check_moe_section(load_config(SFT, sets), torch.nn.Sequential(BareMoE(bias=True)))
        with pytest.raises(ConfigError, match=rf"^{sets[0].split('=')[0]}: the model's MoE routers \(Sequential\) have "
                                              "no score-correction bias"):
            check_moe_section(load_config(SFT, sets), torch.nn.Sequential(BareMoE(bias=False)))


def test_launcher_exits_2_with_one_line_naming_the_key(tmp_path):
    r = run_launcher("pretrain_vlm", ["--config", GRPO, "--set", "train.eval_every=5", "--set",
                                      f'train.output_dir="{tmp_path}"'])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.eval_every:"), r.stderr


def test_grpo_steps_from_epochs_and_rollout_budget():
    rl = NS(batch=NS(prompts_per_step=528))
    assert grpo_total_steps(NS(max_steps=None, epochs=70), rl, 2101) == 279  # ceil(70 * 2101 / 528)
    assert grpo_total_steps(NS(max_steps=7, epochs=70), rl, 2101) == 7
    per_slot = 2 * 36 * 2 * 128 * 2  # K+V x layers x kv_heads x head_dim x bf16 bytes
    per_prompt = per_slot * 4 * 20480  # group of 4, 20480 slots each: 2.8125 GiB
    assert rollout_prompts_for_budget(24.0, per_slot, 4, 20480) == int(24 * 2**30 // per_prompt) == 8
    assert rollout_prompts_for_budget(1.0, per_slot, 4, 20480) == 1  # at least one prompt
    assert rollout_prompts_for_budget(0.0, per_slot, 4, 20480) == 0  # no budget: all at once


DPO = CONFIGS / "demo_dpo.toml"


@pytest.mark.parametrize("config", [SFT, DPO, CONFIGS / "demo_grpo.toml"], ids=lambda p: p.name)
@pytest.mark.parametrize("override, key", [
    ('data.train_path="mine.jsonl"', "data.train_path"),
    ('data.eval_path="mine.jsonl"', "data.eval_path"),
    ('data.image_root="/images"', "data.image_root"),
])
def test_synthetic_data_refuses_the_keys_of_real_data(config, override, key):
    """type = "synthetic_vqa" generates its own files: a train_path given on top of a demo config used to
    train on the synthetic set without a word (the run looked like a run on the user's data)."""
    with pytest.raises(ConfigError, match=rf"^{key}: has no effect with data.type = 'synthetic_vqa'"):
        check_keys_for_mode(load_config(config, [override]))


def test_columns_are_refused_without_an_hf_table():
    sets = ['data.type="messages_jsonl"', 'data.train_path="x.jsonl"', 'data.columns={messages = "conv"}']
    with pytest.raises(ConfigError, match=r"^data.columns: only read with data.type = 'hf'"):
        check_keys_for_mode(load_config(CONFIGS / "internvl3_8b_robovqa_stage1.toml", sets))
    with pytest.raises(ConfigError, match=r"^data.columns: has no effect with data.type = 'synthetic_vqa'"):
        check_keys_for_mode(load_config(SFT, ['data.columns={messages = "conv"}']))


def _eval_job(**sections) -> dict:
    raw = {"model": {"path": "/m"}, "train": {"mode": "eval"},
           "eval": {"benchmarks": [{"name": "b", "path": "/d", "format": "geometry3k"}]}}
    raw.update(sections)
    return raw


@pytest.mark.parametrize("section, table, key", [
    ("dpo", {"beta": 0.5}, "dpo"),
    ("reward", {"margin": 0.5}, "reward"),
    ("logging", {"wandb": True}, "logging.wandb"),
    ("logging", {"tensorboard": False}, "logging.tensorboard"),
])
def test_eval_job_refuses_training_sections(section, table, key):
    """An evaluation job writes its result files only (no metrics logger, no preference loss): these
    sections were loaded and then ignored."""
    from megatron_vlm.config import load_config_dict

    with pytest.raises(ConfigError, match=rf"^{key}: "):
        check_keys_for_mode(load_config_dict(_eval_job(**{section: table})))


def test_wandb_without_the_package_is_a_config_error(monkeypatch, capsys):
    """logging.wandb = true without wandb installed raised a RuntimeError on rank 0 only, after the model and
    optimizer were built (a traceback; the other ranks went on into the first collective and waited there)."""
    from megatron_vlm import runner

    def no_process_group():
        raise AssertionError("the check comes before any process group")

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    monkeypatch.setattr(runner, "init_distributed", no_process_group)
    assert runner.run_job(load_config(SFT, ["logging.wandb=true"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: logging.wandb: true but the wandb package is not installed"), err


def test_grpo_eval_cadence_without_a_held_out_split_is_refused():
    """Without held-out prompts the GRPO evaluation returns nothing at every step: rl.eval.every_steps was ignored
    (as SFT's train.eval_every, refused the same way)."""
    math_grpo = CONFIGS / "qwen2_5_math_1_5b_grpo.toml"  # rl.eval.every_steps = 25
    with pytest.raises(ConfigError, match=r"^rl.eval.every_steps: there is no held-out split to evaluate "
                                          r"\(data.eval_path is empty\)"):
        check_keys_for_mode(load_config(math_grpo, ['data.eval_path=""']))
    check_keys_for_mode(load_config(math_grpo, ['data.eval_path=""', "rl.eval.every_steps=0"]))
    # the synthetic set's evaluation is switched off by its size; a demo's cadence may stay
    check_keys_for_mode(load_config(CONFIGS / "demo_grpo.toml", ["data.synthetic_eval_size=0"]))


@pytest.mark.parametrize("key, layers", [("ssd_chunk_scan", "Mamba2"), ("ssd_state_update", "Mamba2"),
                                         ("causal_conv1d", "Mamba2"), ("grouped_mm", "MoE"), ("moe_permute", "MoE"),
                                         ("moe_unpermute", "MoE"), ("moe_topk_gating", "MoE"),
                                         ("moe_ep_dispatch", "MoE")])
def test_kernel_keys_of_ops_the_model_lacks_are_refused(key, layers):
    """A forced backend for an op the model never runs (Mamba2 ops on a transformer, MoE ops on a dense model)
    was accepted and ignored, like a [moe] section on a dense model (refused above)."""
    from megatron_vlm.models.common.mamba2 import Mamba2Mixer
    from megatron_vlm.models.common.moe import MoE

    cfg = load_config(SFT, [f'kernels.{key}="torch"'])
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=rf"^kernels.{key}: the model \(Sequential\) has no {layers} layers"):
        check_moe_section(cfg, dense)
    cls = Mamba2Mixer if layers == "Mamba2" else MoE
    bare = type("Bare", (cls,), {"__init__": lambda self: torch.nn.Module.__init__(self)})
    check_moe_section(cfg, torch.nn.Sequential(bare()))  # a model with such layers: fine


def test_ep_dispatch_backend_without_expert_parallelism_is_refused():
    with pytest.raises(ConfigError, match=r"^kernels.moe_ep_dispatch: only runs with expert parallelism"):
        check_keys_for_mode(load_config(SFT, ['kernels.moe_ep_dispatch="torch"']))
    check_keys_for_mode(load_config(SFT, ['kernels.moe_ep_dispatch="torch"', "parallel.ep=2"]))


def test_async_grpo_refuses_fewer_prompts_than_training_shards():
    """Each data-parallel training rank of asynchronous GRPO trains on groups of its own: 1 prompt per step for 2
    shards passed and stopped the job at step 1 (a RuntimeError on the rank without a group); tp ranks share one."""
    demo = CONFIGS / "demo_grpo_async.toml"
    two = ['rl.allocation="rollout:1+train:2"', "rl.batch.prompts_per_step=1"]
    with pytest.raises(ConfigError, match=r"^rl.batch.prompts_per_step: 1 prompts per step for 2 data-parallel"):
        check_keys_for_mode(load_config(demo, two))
    check_keys_for_mode(load_config(demo, [*two, "parallel.tp=2"]))  # one shard of two tp ranks
    check_keys_for_mode(load_config(demo, [two[0], "rl.batch.prompts_per_step=2"]))


def test_eval_job_refuses_a_generation_budget_that_leaves_no_room_for_a_prompt():
    """eval.max_new_tokens close to data.max_tokens_per_pack left no prompt budget: the job built the model and
    then stopped with a ValueError traceback (exit 1) at the first benchmark; a config error names both keys."""
    from megatron_vlm.config import load_config_dict

    raw = _eval_job(data={"max_tokens_per_pack": 4096})
    raw["eval"]["max_new_tokens"] = 4096  # a reasoning model's budget with the default pack size
    with pytest.raises(ConfigError, match=r"^eval.max_new_tokens: 4096 leaves 0 tokens .*data.max_tokens_per_pack"):
        check_keys_for_mode(load_config_dict(raw))
    raw["eval"]["max_new_tokens"] = 4096 - 16
    check_keys_for_mode(load_config_dict(raw))


def test_an_eval_key_outside_eval_mode_names_the_section_not_the_benchmarks():
    """`--set eval.max_new_tokens=8` on an SFT config: [eval] is refused as a whole for the mode, not with "at least
    one [[eval.benchmarks]] table is required" (which sends the user to add benchmarks to an SFT run)."""
    from megatron_vlm.config import load_config_dict

    with pytest.raises(ConfigError, match=r'^eval: the \[eval\] section is only read when train.mode = "eval"'):
        check_keys_for_mode(load_config(SFT, ["eval.max_new_tokens=8"]))
    with pytest.raises(ConfigError, match=r"^eval.benchmarks: at least one \[\[eval.benchmarks\]\] table is required"):
        load_config_dict(_eval_job(eval={"max_new_tokens": 8}))
