"""`--unset KEY` (also `--set '~KEY'`): a key the config file sets taken back out, so that its default applies, in
command-line order with the `--set` items; TOML has no null, so no `--set` could do it. A key no section has, a list
entry and a key the file does not set exit 2 naming the key."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tomllib

from megatron_vlm.config import ConfigError, load_config, load_config_dict, save_config
from megatron_vlm.config.loader import apply_overrides
from megatron_vlm.config.stage_configs import stage_configs
from tests.unit.launch_scripts import import_launch_script

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "launch" / "configs"
SFT, VIDEO = CONFIGS / "demo_sft.toml", CONFIGS / "demo_internvl_video.toml"
GRPO = CONFIGS / "demo_grpo_reward_model.toml"  # two [[rl.rewards]] entries, the second with weight 0


def _raw(**sections) -> dict:
    raw = {"model": {"path": "/tmp/m"}, "data": {"type": "synthetic_vqa"}, "train": {"max_steps": 3},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.5}}
    raw.update(sections)
    return raw


def test_unset_a_run_length_composes_with_the_set_of_the_other_in_either_order():
    """A recipe that gives train.max_steps run for epochs instead: unset before or after the --set, and the --set
    alone, which already drops the file's other length key (the unset of a key it dropped is no error)."""
    for items in (["~train.max_steps", "train.epochs=2"], ["train.epochs=2", "~train.max_steps"], ["train.epochs=2"]):
        cfg = load_config(SFT, items)
        assert (cfg.train.max_steps, cfg.train.epochs) == (None, 2.0), items
    with pytest.raises(ConfigError, match=r"^train.max_steps: set max_steps or epochs"):
        load_config(SFT, ["~train.max_steps"])  # the default is neither: the config's own refusal names it


def test_an_unset_after_a_section_reset_to_its_defaults_is_no_error():
    """`--set train={}` puts the section back to its defaults (the file's keys out), so a later unset of one of
    them finds its intent met, as after a --set that dropped it; a key no section has is still refused."""
    raw = apply_overrides(_raw(), ["optimizer={}", "~optimizer.lr"])
    assert raw["optimizer"] == {}
    with pytest.raises(ConfigError, match=r"^optimizer.lrr: unknown key"):
        load_config_dict(_raw(), ["optimizer={}", "~optimizer.lrr"])


def test_set_and_unset_apply_in_the_order_given():
    raw = apply_overrides(_raw(), ["~optimizer", "optimizer.lr=1e-3"])
    assert raw["optimizer"] == {"lr": 1e-3}  # the table afresh: the file's weight_decay is gone
    raw = apply_overrides(_raw(), ["optimizer.lr=1e-3", "~optimizer.lr"])
    assert raw["optimizer"] == {"weight_decay": 0.5}
    assert load_config_dict(_raw(), ["optimizer.lr=1e-3", "~optimizer.lr"]).optimizer.lr == 1e-5  # its default


def test_hydras_spelling_is_the_same_item():
    assert apply_overrides(_raw(), ["~optimizer.weight_decay"]) == apply_overrides(_raw(), [" ~ optimizer.weight_decay"])


def test_a_key_of_an_entry_and_a_whole_optional_table():
    cfg = load_config(GRPO, ["~rl.rewards[1].weight", "~rl.eval"])
    base = load_config(GRPO)
    assert base.rl.rewards[1].weight != 1.0 and cfg.rl.rewards[1].weight == 1.0  # RewardConfig's default
    assert cfg.rl.rewards[0] == base.rl.rewards[0]
    assert base.rl.eval != cfg.rl.eval == type(base.rl.eval)()
    assert load_config(GRPO, ["~rl.rewards.1.weight"]).rl.rewards[1].weight == 1.0  # the dotted index spelling
    whole = load_config_dict(_raw(lora={"r": 8}, eval={"samples": 2}))
    assert whole.lora is not None and whole.eval is not None
    cfg = load_config_dict(_raw(lora={"r": 8}, eval={"samples": 2}), ["~lora", "~eval"])
    assert cfg.lora is None and cfg.eval is None


def test_a_stage_key_unset_gives_the_stage_the_main_value():
    cfg = load_config(VIDEO, ["~stages[1].lr", "optimizer.lr=2e-4", "~stages[0].max_steps", "stages[0].epochs=1"])
    s1, s2 = stage_configs(cfg)
    assert (s1.optimizer.lr, s2.optimizer.lr) == (3e-3, 2e-4)
    assert (s1.train.max_steps, s1.train.epochs, s2.train.max_steps) == (None, 1.0, 100)


def test_the_resolved_config_does_not_hold_an_unset_key(tmp_path):
    """The run folder's config.toml (save_config) is what a resumed or repeated run reads: the key must stay out."""
    cfg = load_config(SFT, ["~model.synthesize", "~train.max_steps", "train.epochs=1"])
    save_config(cfg, tmp_path / "config.toml")
    saved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert "synthesize" not in saved["model"] and "max_steps" not in saved["train"] and saved["train"]["epochs"] == 1
    assert load_config(tmp_path / "config.toml") == cfg


def test_an_unset_switch_acts_as_its_default_and_drops_the_keys_it_leaves_idle():
    """wandb is off by default: unsetting it drops the file's project, as `--set logging.wandb=false` does,
    instead of the project being refused as a key without effect."""
    raw = _raw(logging={"wandb": True, "wandb_project": "p", "csv": True})
    assert apply_overrides(raw, ["~logging.wandb"], schema=type(load_config_dict(_raw())))["logging"] == {"csv": True}


@pytest.mark.parametrize("item, expect", [
    ("~train.epochs", r"^train.epochs: --unset: the config does not set it, nothing to unset"),
    ("~eval.samples", r"^eval.samples: --unset: the config does not set it"),
    ("~rl.rewards[1]", r"^rl.rewards\[1\]: --unset removes a key, not an entry of a list .*--set rl.rewards=\[\.\.\.\]"),
    ("~rl.rewards.0", r"^rl.rewards\[0\]: --unset removes a key, not an entry of a list"),
    ("~rl.rewards[5].weight", r"^rl.rewards\[5\]: no such entry \(the list has 2"),
    ("~rl.rewards.weight", r"^rl.rewards: a list of tables; name an entry by its index"),
    ("~train.max_steps.x", r"^train.max_steps: is a value, not a table"),
    ("~train.max_steps=3", r"^--unset 'train.max_steps=3': takes a key, not key=value"),
    ("~", r"^--unset: needs a key"),
    ("~train..seed", r"^--unset 'train..seed': empty key segment"),
])
def test_what_cannot_be_unset_names_the_key(item, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(GRPO, [item])


@pytest.mark.parametrize("key, expect", [("optimizer.lrr", "optimizer.lrr: unknown key; did you mean lr?"),
                                         ("nosuch", "nosuch: unknown key; valid keys: checkpoint, data, dpo, "),
                                         ("rl.rewards[0].wieght", "rl.rewards[0].wieght: unknown key; did you mean weight?")])
def test_an_unknown_key_gets_the_message_a_set_of_it_gets(key, expect):
    with pytest.raises(ConfigError) as by_set:
        load_config(GRPO, [f"{key}=1"])
    with pytest.raises(ConfigError) as by_unset:
        load_config(GRPO, [f"~{key}"])
    assert str(by_unset.value) == str(by_set.value) and str(by_set.value).startswith(expect)


def test_the_slurm_script_drops_an_unset_output_dir(tmp_path):
    """train.sbatch picks the run folder before torchrun (resolve_output_dir.py): with the file's output_dir unset it
    gives the job its own runs/<name>-<id>/ (and passes it on as a later --set), as the loader drops the key."""
    spec = importlib.util.spec_from_file_location("resolve_output_dir", REPO / "launch" / "slurm" / "resolve_output_dir.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.resolve_output_dir(str(SFT), []) == "runs/demo_sft"
    for args in (["--unset", "train.output_dir"], ["--unset=train"], ["--set", "~train.output_dir"]):
        assert mod.resolve_output_dir(str(SFT), args) is None, args
    later = str(tmp_path / "x")
    assert mod.resolve_output_dir(str(SFT), ["--unset", "train.output_dir", "--set", f"train.output_dir={later}"]) == later
    assert mod.overrides_from_argv(["--set", "a=1", "--unset", "b", "--unset=c", "--set=d=2"]) == ["a=1", "~b", "~c", "d=2"]
    # the loader strips the spaces around an unset key (a quoted `' train.output_dir'`): so does the script
    for args in (["--unset", " train.output_dir"], ["--set", "~ train.output_dir "], ["--set", " ~ train.output_dir"]):
        item = mod.overrides_from_argv(args)[0]
        assert load_config(SFT, [item]).train.output_dir != "runs/demo_sft", args
        assert mod.resolve_output_dir(str(SFT), args) is None, args



def test_the_launcher_keeps_the_order_of_set_and_unset():
    pretrain = import_launch_script("pretrain_vlm")
    args = pretrain.parse_args(["--config", "x.toml", "--unset", "eval", "--set", "eval.samples=1", "--unset=lora"])
    assert args.overrides == ["~eval", "eval.samples=1", "~lora"]
    assert pretrain.parse_args(["--config", "x.toml"]).overrides == []


@pytest.mark.parametrize("argv, code, expect", [
    (["--unset", "train.max_steps", "--set", "train.epochs=1"], 0, "check ok"),
    (["--unset", "train.epochs"], 2, "config error: train.epochs: --unset: the config does not set it"),
])
def test_check_with_unset_exits_0_or_2(argv, code, expect, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    pretrain = import_launch_script("pretrain_vlm")
    full = ["--config", str(SFT), "--check", "--world-size", "1", "--device-memory-gib", "80", *argv]
    if code == 0:
        assert pretrain.main(full) == 0
    else:
        with pytest.raises(SystemExit) as e:
            pretrain.main(full)
        assert e.value.code == 2
    cap = capsys.readouterr()
    assert expect in cap.out + cap.err


@pytest.mark.parametrize("argv", [["--unset", "train.mode"], ["--unset=train"], ["--set", "~train.mode"]])
def test_evaluate_refuses_to_unset_the_eval_mode(argv, capsys):
    """launch/evaluate.py sets train.mode = "eval" first; an unset of it (or of [train]) would leave the default
    training mode."""
    ev = import_launch_script("evaluate")
    with pytest.raises(SystemExit) as e:
        ev.main(["--config", "/nonexistent.toml", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "launch/evaluate.py sets train.mode" in err and "config file not found" not in err
    ev._refuse_a_training_mode(["--config", "x.toml", "--unset", "optimizer", "--unset", "train.max_steps"])


def test_a_date_stamped_folder_given_bare_is_its_text(tmp_path):
    """`--set train.output_dir=2024-01-01` parsed as a TOML date and was refused ("expected a string, got date");
    no key takes a date, so a bare one is its text, in the loader and in the Slurm script's resolver alike."""
    from megatron_vlm.config.loader import parse_override_value

    spec = importlib.util.spec_from_file_location("resolve_output_dir", REPO / "launch" / "slurm" / "resolve_output_dir.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for text in ("2024-01-01", "2024-01-01T10:30:00", "10:30:00"):
        assert parse_override_value(text, "train.output_dir") == text == mod.override_value(text)
    assert load_config(SFT, ["train.output_dir=2024-01-01"]).train.output_dir == "2024-01-01"
    assert mod.resolve_output_dir(str(SFT), ["--set", "train.output_dir=2024-01-01"]) == "2024-01-01"
