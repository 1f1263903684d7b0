"""Keys outside [rl] that a run would parse and then ignore, and values that would fail deep in the job, are
refused at load (exit 2 naming the dotted key): the SFT evaluation switches without a held-out split, loader
keys without workers, W&B keys without W&B, scheduler keys the schedule never reads, LoRA keys an `init_from`
adapter overrides, the MoE bias rate without bias updates, the sampled pass's keys of an evaluation without one, and
a seed numpy cannot take."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from tests.fixtures.eval_config import write_eval_config
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"
SFT = CONFIGS / "demo_sft.toml"  # synthetic_vqa
REAL = CONFIGS / "internvl3_8b_robovqa_stage1.toml"  # messages_jsonl with a held-out split
NO_SPLIT = ['data.eval_path=""', "train.eval_every=0", "train.eval_max_batches=0"]


def _refused(config: Path, sets: list[str], key: str, why: str = "") -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: {why}"):
        check_keys_for_mode(load_config(config, sets))


def _accepted(config: Path, sets: list[str]) -> None:
    check_keys_for_mode(load_config(config, sets))


def test_sft_eval_generate_needs_a_held_out_split():
    _refused(REAL, NO_SPLIT, "train.eval_generate", "there is no held-out split")  # the file sets it false
    _accepted(REAL, [*NO_SPLIT, "train.eval_generate=true"])
    _accepted(REAL, [])


def test_prefetch_factor_needs_loader_workers():
    _refused(SFT, ["data.num_workers=0", "data.prefetch_factor=4"], "data.prefetch_factor",
             "has no effect with data.num_workers = 0")
    _accepted(SFT, ["data.num_workers=2", "data.prefetch_factor=4"])


@pytest.mark.parametrize("key, value", [("wandb_project", '"p"'), ("wandb_mode", '"online"'),
                                        ("experiment_name", '"e"')])
def test_wandb_keys_need_wandb(key, value):
    _refused(SFT, [f"logging.{key}={value}"], f"logging.{key}", "only read with logging.wandb = true")
    _accepted(SFT, ["logging.wandb=true", f"logging.{key}={value}"])


def test_scheduler_keys_the_schedule_never_reads(tmp_path):
    both = tmp_path / "both.toml"  # warmup_steps = 20 in the file, and a ratio beside it
    both.write_text(SFT.read_text().replace("warmup_steps = 20", "warmup_steps = 20\nwarmup_ratio = 0.1"))
    _refused(both, [], "scheduler.warmup_ratio", "set warmup_steps or warmup_ratio")
    constant = tmp_path / "constant.toml"  # a constant schedule with the floor of a decaying one in the file
    constant.write_text(SFT.read_text().replace('type = "cosine"', 'type = "constant"'))
    _refused(constant, [], "scheduler.min_lr_ratio", "not read with type = 'constant'")
    _refused(SFT, ['scheduler.type="constant"', "scheduler.min_lr_ratio=0.2"], "scheduler.min_lr_ratio",
             "not read with type = 'constant'")
    # switched on the command line over a cosine recipe: the file's floor is dropped (config/loader.py)
    _accepted(SFT, ['scheduler.type="constant"'])
    _accepted(SFT, ['scheduler.type="constant"', "scheduler.min_lr_ratio=0"])


def test_a_warmup_on_the_command_line_replaces_the_files_other_warmup_key():
    """As with the run length: `--set scheduler.warmup_ratio=0.1` on a recipe with warmup_steps is what is meant."""
    cfg = load_config(SFT, ["scheduler.warmup_ratio=0.1"])
    assert (cfg.scheduler.warmup_steps, cfg.scheduler.warmup_ratio) == (0, 0.1)
    cfg = load_config(REAL, ["scheduler.warmup_steps=1"])  # the file's warmup_ratio = 0.03
    assert (cfg.scheduler.warmup_steps, cfg.scheduler.warmup_ratio) == (1, 0.0)
    with pytest.raises(ConfigError, match=r"^scheduler.warmup_ratio: set warmup_steps or warmup_ratio"):
        load_config(SFT, ["scheduler.warmup_ratio=0.1", "scheduler.warmup_steps=3"])


def test_turning_wandb_off_on_the_command_line_drops_the_files_wandb_keys():
    """A recipe naming its W&B project and run (the Nemotron SFT configs) with `--set logging.wandb=false`: the
    idle keys come from the file, so they are dropped, not refused; given on the command line too, refused."""
    nemotron = SFT.parent / "nemotron_3_nano_vl_sft.toml"
    cfg = load_config(nemotron, ["logging.wandb=false"])
    assert cfg.logging.wandb is False and cfg.logging.experiment_name != "alignment"
    with pytest.raises(ConfigError, match=r"^logging.wandb_project: only read with logging.wandb = true"):
        load_config(nemotron, ["logging.wandb=false", 'logging.wandb_project="p"'])


LORA = ["lora.r=8", 'train.train_layers=[]']


def test_lora_keys_an_init_from_adapter_overrides():
    _refused(SFT, [*LORA, 'lora.init_from="a"', 'lora.init="gaussian"'], "lora.init",
             "the continued adapter's factors")
    _accepted(SFT, [*LORA, 'lora.init_from="a"', 'lora.init_from_mode="merge"', 'lora.init="gaussian"'])
    for mode in ("continue", "merge"):
        _refused(SFT, [*LORA, 'lora.init_from="a"', f'lora.init_from_mode="{mode}"', "lora.include_vision=true"],
                 "lora.include_vision", "with lora.init_from and no target_modules")
    _accepted(SFT, [*LORA, 'lora.init_from="a"', 'lora.target_modules=["q_proj"]', "lora.include_vision=true"])


def test_moe_bias_rate_needs_bias_updates():
    _refused(SFT, ["moe.enable_moe_load_balancing_training=false", "moe.bias_update_rate=0.01"],
             "moe.bias_update_rate", "has no effect with enable_moe_load_balancing_training = false")


def test_check_refuses_bias_balancing_keys_for_routers_without_a_bias(tmp_path):
    """Qwen3-MoE routers have no score-correction bias: the bias rate moved nothing, said nothing (--check and the
    job share check_moe_section). The entry point with a tiny Qwen3-VL-MoE built in a temporary folder."""
    base = ["--config", str(CONFIGS / "demo_qwen3_vl.toml"), "--check", "--device-memory-gib", "80",
            "--set", 'model.synthesize="tiny_qwen3_vl_moe"', "--set", f'model.path="{tmp_path / "m"}"',
            "--set", f'train.output_dir="{tmp_path / "run"}"']
    r = run_launcher("pretrain_vlm", [*base, "--set", "moe.bias_update_rate=0.01"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("check failed: moe.bias_update_rate: the model's MoE routers"), \
        r.stderr[-2000:]


@pytest.mark.parametrize("key, value", [("temperature", "0.7"), ("top_p", "0.9"), ("top_k", "20")])
def test_eval_sampling_keys_need_the_sampled_pass(tmp_path, key, value):
    config = write_eval_config(tmp_path / "eval.toml", tmp_path / "model", tmp_path / "out",
                               [{"name": "b", "path": tmp_path / "b.jsonl", "format": "messages"}],
                               train={"mode": "eval"})
    _refused(config, [f"eval.{key}={value}"], f"eval.{key}", "only read by the sampled pass")
    _accepted(config, [f"eval.{key}={value}", "eval.samples=4"])


@pytest.mark.parametrize("sets, key", [
    (["train.seed=-1"], "train.seed"),
    (["train.seed=4294967296"], "train.seed"),
    (["train.eval_max_batches=-1"], "train.eval_max_batches"),
    (["train.log_every=0"], "train.log_every"),
    (["train.eval_every=-1"], "train.eval_every"),
])
def test_out_of_range_train_values_name_their_key(sets, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be"):
        load_config(SFT, sets)


def test_entry_point_exits_2_naming_the_key(tmp_path):
    """Through launch/pretrain_vlm.py --check: one line, exit 2 (a negative seed was a numpy traceback at start)."""
    r = run_launcher("pretrain_vlm", ["--config", SFT, "--check", "--device-memory-gib", "80", "--set", "train.seed=-1",
                                      "--set", f'train.output_dir="{tmp_path}"'])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.seed: must be"), r.stderr


def test_switching_off_on_the_command_line_drops_the_files_idle_keys(tmp_path):
    """The refusals above, met by a `--set` that switches a feature off on a recipe setting its keys: the keys come
    from the file, so they are dropped, not refused (as with `logging.wandb=false`); given with `--set` too, they
    stay refused. `--set data.num_workers=0` (a loader debugged in the main process) on the Nemotron SFT recipe,
    which sets data.prefetch_factor; docs/evaluation.md's `--set eval.samples=0` on an evaluation that sets its
    sampling temperature; a recipe's MoE bias rate under `--set moe.enable_moe_load_balancing_training=false`."""
    nemotron = CONFIGS / "nemotron_3_nano_vl_sft.toml"
    cfg = load_config(nemotron, ["data.num_workers=0"])
    check_keys_for_mode(cfg)
    assert cfg.data.num_workers == 0
    _refused(nemotron, ["data.num_workers=0", "data.prefetch_factor=4"], "data.prefetch_factor", "has no effect")
    _refused(nemotron, ["data.num_workers=0", "data.loader_timeout_s=60"], "data.loader_timeout_s", "has no effect")

    config = write_eval_config(tmp_path / "eval.toml", tmp_path / "model", tmp_path / "out",
                               [{"name": "b", "path": tmp_path / "b.jsonl", "format": "messages"}],
                               train={"mode": "eval"}, eval={"samples": 8, "temperature": 0.6, "top_k": 20})
    cfg = load_config(config, ["eval.samples=0"])
    assert (cfg.eval.samples, cfg.eval.temperature, cfg.eval.top_k) == (0, 1.0, 0)
    with pytest.raises(ConfigError, match=r"^eval.temperature: only read by the sampled pass"):
        load_config(config, ["eval.samples=0", "eval.temperature=0.6"])

    moe = tmp_path / "moe.toml"
    moe.write_text(SFT.read_text() + "\n[moe]\nbias_update_rate = 0.01\n")
    cfg = load_config(moe, ["moe.enable_moe_load_balancing_training=false"])
    assert (cfg.moe.enable_moe_load_balancing_training, cfg.moe.bias_update_rate) == (False, 1e-3)


def test_checkpoint_save_keys_need_checkpointing(tmp_path):
    """`checkpoint.every_steps` / `keep_last` shape the checkpoints a run writes: with `checkpoint.enable = false` it
    writes none, and they were accepted and read by nothing. `enable` defaults to true, so a file setting only
    every_steps saves as it says; `--set checkpoint.enable=false` on a recipe that sets them (the commands of
    megatron_vlm/rl/README.md on demo_grpo.toml) drops the file's keys, as `logging.wandb=false` does."""
    for key, value in (("every_steps", 5), ("keep_last", 0)):
        _refused(SFT, ["checkpoint.enable=false", f"checkpoint.{key}={value}"], f"checkpoint.{key}",
                 r"only read with checkpoint.enable = true .*set enable = true")
    off = tmp_path / "off.toml"  # written in the file itself
    off.write_text(SFT.read_text().replace("[checkpoint]\n", "[checkpoint]\nenable = false\n"))  # every_steps = 200
    _refused(off, [], "checkpoint.every_steps", "only read with checkpoint.enable = true")
    cfg = load_config(SFT, ["checkpoint.every_steps=5"])  # enable's default: true
    assert (cfg.checkpoint.enable, cfg.checkpoint.every_steps) == (True, 5)
    _accepted(SFT, ["checkpoint.enable=false", "checkpoint.every_steps=0", "checkpoint.keep_last=2"])  # defaults
    grpo = CONFIGS / "demo_grpo.toml"  # every_steps = 50, keep_last = 1
    cfg = load_config(grpo, ["checkpoint.enable=false"])
    check_keys_for_mode(cfg)
    assert (cfg.checkpoint.enable, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last) == (False, 0, 2)


@pytest.mark.parametrize("key, value", [("synthetic_dir", '"d"'), ("synthetic_train_size", "8"),
                                        ("synthetic_eval_size", "4"), ("synthetic_seed", "3"),
                                        ("synthetic_image_size", "28")])
def test_synthetic_keys_need_synthetic_data(key, value):
    """The `data.synthetic_*` keys shape the generated set, read only with `data.type = "synthetic_vqa"`; with
    another type they were accepted and did nothing."""
    _refused(REAL, [f"data.{key}={value}"], f"data.{key}", "only read with data.type = 'synthetic_vqa'")
    _accepted(SFT, [f"data.{key}={value}"])


def test_switching_data_type_on_the_command_line_drops_the_other_sources_keys():
    """`--set data.type=...` on a recipe written for another source: the file's keys of that source are idle and
    dropped (the synthetic_* keys of demo_sft.toml; a real recipe's paths under `data.type="synthetic_vqa"`); given
    with `--set` too, they stay refused."""
    cfg = load_config(SFT, ['data.type="messages_jsonl"', 'data.train_path="t.jsonl"', 'data.eval_path="e.jsonl"'])
    check_keys_for_mode(cfg)
    assert (cfg.data.synthetic_dir, cfg.data.synthetic_train_size, cfg.data.synthetic_eval_size) == ("", 512, 64)
    _refused(SFT, ['data.type="messages_jsonl"', 'data.train_path="t.jsonl"', "data.synthetic_train_size=8"],
             "data.synthetic_train_size", "only read with data.type = 'synthetic_vqa'")
    cfg = load_config(REAL, ['data.type="synthetic_vqa"'])
    check_keys_for_mode(cfg)
    assert (cfg.data.train_path, cfg.data.eval_path, cfg.data.image_root) == ("", "", "")
    _refused(REAL, ['data.type="synthetic_vqa"', 'data.train_path="t.jsonl"'], "data.train_path", "has no effect")
