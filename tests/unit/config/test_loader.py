"""Strict config loading: every error class names its dotted key; the CLI exits 2 without a traceback."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest
import tomllib

from megatron_vlm.config import Config, ConfigError, load_config, load_config_dict, save_config
from megatron_vlm.config.loader import apply_overrides, field_docs, from_dict, parse_override_value
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]

BASE = {
    "model": {"path": "/tmp/some-model"},
    "data": {"type": "synthetic_vqa"},
    "train": {"max_steps": 3},
    "optimizer": {"lr": 1e-4},
}


def _raw(**changes):
    import copy

    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        sec, key = dotted.split("__")
        if not key:  # a whole top-level value (an array of tables)
            raw[sec] = value
            continue
        raw.setdefault(sec, {})[key] = value
    return raw


def test_minimal_config_builds_with_defaults():
    cfg = load_config_dict(_raw())
    assert cfg.optimizer.lr == 1e-4
    assert cfg.scheduler.type == "cosine"
    assert cfg.train.mode == "sft"


@pytest.mark.parametrize(
    "raw_change, expect",
    [
        ({"optimizer__lrr": 1e-3}, "optimizer.lrr: unknown key; did you mean lr?"),
        ({"optimizer__lr": "fast"}, "optimizer.lr: expected a number"),
        ({"optimizer__lr": -1.0}, "optimizer.lr: must be > 0"),
        ({"train__micro_batches_per_step": 0}, "train.micro_batches_per_step: must be > 0"),
        ({"train__activation_checkpointing": "yes"},
         "train.activation_checkpointing: expected true, false, 'full' or 'selective', got str 'yes'"),
        ({"train__activation_checkpointing": 1}, "train.activation_checkpointing: expected true, false, 'full' or 'selective'"),
        ({"scheduler__type": "cosin"}, "scheduler.type: must be one of"),
        ({"train__max_steps": 1.5}, "train.max_steps: expected an integer"),
        # both lengths: max_steps would decide and epochs be parsed, then ignored
        ({"train__epochs": 2.0}, "train.epochs: set max_steps or epochs, not both"),
        ({"checkpoint__export_dtype": "bfloat16", "checkpoint__export_hf": False},
         "checkpoint.export_dtype: 'bfloat16' has no effect with export_hf = false"),
        ({"checkpoint__export_dtype": "float16"}, "checkpoint.export_dtype: must be one of"),
        ({"stages__": [{"name": "a", "max_steps": 2, "epochs": 1.0}]}, "stages[0].epochs: set max_steps or epochs, not both"),
    ],
)
def test_error_names_the_key(raw_change, expect):
    with pytest.raises(ConfigError) as e:
        load_config_dict(_raw(**raw_change))
    assert expect in str(e.value)


def test_missing_required_value():
    raw = _raw()
    del raw["model"]["path"]
    with pytest.raises(ConfigError, match=r"model\.path: required value is missing"):
        load_config_dict(raw)


def test_unknown_section_is_an_error():
    raw = _raw()
    raw["optimiser"] = {"lr": 1.0}
    with pytest.raises(ConfigError, match=r"optimiser: unknown key; did you mean optimizer\?"):
        load_config_dict(raw)


def test_set_overrides_parse_toml_values():
    raw = apply_overrides(_raw(), ["optimizer.lr=3e-4", "train.train_layers=['merger']", "model.path=/ckpt/x-3B"])
    assert raw["optimizer"]["lr"] == 3e-4
    assert raw["train"]["train_layers"] == ["merger"]
    assert raw["model"]["path"] == "/ckpt/x-3B"
    assert parse_override_value("true") is True
    assert parse_override_value('"a b"') == "a b"
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_overrides({}, ["optimizer.lr"])
    with pytest.raises(ConfigError, match=r"optimizer\.lrr: unknown key"):
        load_config_dict(_raw(), ["optimizer.lrr=1.0"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config_dict(_raw(), ["train.seed=7"])
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg
    assert tomllib.loads((tmp_path / "config.toml").read_text())["train"]["seed"] == 7


@dataclass(kw_only=True)
class _A:
    type: Literal["a"]
    x: int = 0


@dataclass(kw_only=True)
class _B:
    type: Literal["b"]
    y: str = ""


@dataclass(kw_only=True)
class _Holder:
    item: _A | _B
    opt: Optional[int] = None
    items: list[_A | _B] = field(default_factory=list)


def test_union_of_tables_needs_explicit_type():
    B, Holder = _B, _Holder
    assert from_dict(Holder, {"item": {"type": "b", "y": "q"}}).item == B(type="b", y="q")
    with pytest.raises(ConfigError, match=r"item\.type: required"):
        from_dict(Holder, {"item": {"x": 1}})
    with pytest.raises(ConfigError, match=r"items\[1\]\.type: must be one of"):
        from_dict(Holder, {"item": {"type": "a"}, "items": [{"type": "a"}, {"type": "c"}]})


def test_every_section_field_is_documented():
    import dataclasses

    docs = field_docs(Config)
    for f in dataclasses.fields(Config):
        assert f.name in docs, f"Config.{f.name} has no docstring"
    from megatron_vlm.config import sections

    for cls in [sections.ModelConfig, sections.TrainConfig, sections.OptimizerConfig, sections.SchedulerConfig,
                sections.ParallelConfig, sections.CheckpointConfig, sections.LoggingConfig]:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__}: undocumented fields {missing}"


@pytest.mark.parametrize(
    "extra_args, expect",
    [
        (["--set", "optimizer.lrr=1e-3"], "optimizer.lrr: unknown key; did you mean lr?"),
        (["--set", "optimizer.lr=-1e-3"], "optimizer.lr: must be > 0"),
        (["--set", "train.micro_batches_per_step=0"], "train.micro_batches_per_step: must be > 0"),
    ],
)
def test_cli_exits_2_with_a_short_message(tmp_path, extra_args, expect):
    import tomli_w

    cfg = tmp_path / "x.toml"
    cfg.write_text(tomli_w.dumps(_raw()))
    r = run_launcher("pretrain_vlm", ["--config", cfg, *extra_args], cwd=None)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_config_file(tmp_path):
    """A real process: its exit status and all it prints on stderr (the refusals above run the launcher in-process)."""
    r = subprocess.run([sys.executable, str(REPO / "launch/pretrain_vlm.py"), "--config", str(tmp_path / "nope.toml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config file not found" in r.stderr and "Traceback" not in r.stderr


def test_config_file_not_utf8_or_a_folder_is_a_config_error(tmp_path):
    """A config saved in Latin-1 (an accented path) was a UnicodeDecodeError traceback; a folder given
    as --config was called "not found"."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[model]\npath = "/data/caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml: not valid TOML: not UTF-8 text \(byte 0xe9 at offset 25\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r": is a folder, not a config file"):
        load_config(tmp_path)


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_output_dir_is_refused(value):
    """`--set train.output_dir=$RUN` with $RUN unset gave "": the run wrote its checkpoints, lock and metrics
    into the current folder (and resume = "auto" took any checkpoints/ found there)."""
    with pytest.raises(ConfigError, match=r"^train.output_dir: must not be empty"):
        load_config_dict(_raw(train__output_dir=value))


def test_an_empty_train_layers_pattern_is_refused():
    """An empty regex matches every parameter name: train.train_layers = [""] would freeze nothing, silently."""
    with pytest.raises(ConfigError, match=r"^train.train_layers: an empty pattern matches every parameter"):
        load_config_dict(_raw(train__train_layers=["visual", ""]))
    assert load_config_dict(_raw(train__train_layers=["visual"])).train.train_layers == ["visual"]


REPO = Path(__file__).resolve().parents[3]


def test_a_set_run_length_replaces_the_files_other_one():
    """`--set train.max_steps=N` on a recipe that sets train.epochs (docs/training.md, docs/slurm.md) runs N steps,
    and `--set train.epochs` on a max_steps config runs epochs: the command line's length replaces the file's;
    both on the command line are still refused."""
    cfg = load_config(REPO / "launch/configs/qwen2_5_vl_3b_geometry3k_grpo.toml",
                      ["train.max_steps=200", "model.path=/ckpt/Qwen2.5-VL-3B-Instruct"])
    assert (cfg.train.max_steps, cfg.train.epochs) == (200, None)
    cfg = load_config(REPO / "launch/configs/demo_sft.toml", ["train.epochs=2"])
    assert (cfg.train.max_steps, cfg.train.epochs) == (None, 2.0)
    with pytest.raises(ConfigError, match="train.epochs: set max_steps or epochs, not both"):
        load_config(REPO / "launch/configs/demo_sft.toml", ["train.epochs=2", "train.max_steps=3"])


@pytest.mark.parametrize("item, key", [
    ('model.path="/data/my\\models"', "model.path"),  # \m is no TOML escape: was the text, quotes included
    ('train.output_dir="runs/x', "train.output_dir"),  # unterminated: was a folder named `"runs/x`
    ("train.output_dir='runs/x", "train.output_dir"),
    ("train.train_layers=['visual', ", "train.train_layers"),
    ("model={path='x'", "model"),
    ("train.max_steps=5\ntrain.seed=3", "train.max_steps"),  # two values in one: the second was dropped
])
def test_a_set_value_that_is_not_one_toml_value_names_the_key(item, key):
    """A `--set` value written as TOML (quoted, a list, a table) that does not parse was taken as the bare text,
    quotes and brackets included, and a value holding a second `key = value` line lost it silently."""
    with pytest.raises(ConfigError, match=rf"^{key}: --set value .* is not one TOML value"):
        apply_overrides(_raw(), [item])


def test_bare_words_and_toml_values_still_parse():
    raw = apply_overrides(_raw(), ["model.path=/ckpt/my model", "train.output_dir=runs/a=b", "data.image_root=",
                                   "model.synthesize=tiny_qwen2_5_vl", "optimizer.lr=1e-5", 'train.seed=7 # note'])
    assert raw["model"]["path"] == "/ckpt/my model" and raw["train"]["output_dir"] == "runs/a=b"
    assert raw["data"]["image_root"] == "" and raw["model"]["synthesize"] == "tiny_qwen2_5_vl"
    assert raw["optimizer"]["lr"] == 1e-5 and raw["train"]["seed"] == 7


def test_evaluate_cli_refuses_a_malformed_train_mode_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "launch/evaluate.py"), "--config", str(tmp_path / "x.toml"),
                        "--set", 'train.mode="eval'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "config error: train.mode: --set value" in r.stderr


def test_a_home_folder_in_a_path_key_is_expanded(monkeypatch, tmp_path):
    """`train.output_dir = "~/runs/x"` (in the file or a `--set`: neither the shell nor TOML expands it) made a folder
    named `~` in the current folder, and `model.path = "~/m"` with model.synthesize built the model there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config_dict(_raw(train__output_dir="~/runs/x", model__synthesize="tiny_qwen2_5_vl", model__path="~/m",
                                data__synthetic_dir="~", logging__wandb=True,
                                logging__experiment_name="~x"),
                           ["data.length_cache_dir=~/cache", "checkpoint.resume=~/old/checkpoints/step_4"])
    assert cfg.train.output_dir == f"{tmp_path}/runs/x" and cfg.model.path == f"{tmp_path}/m"
    assert cfg.data.synthetic_dir == str(tmp_path) and cfg.data.length_cache_dir == f"{tmp_path}/cache"
    assert cfg.checkpoint.resume == f"{tmp_path}/old/checkpoints/step_4"
    assert cfg.logging.experiment_name == "~x"  # a name, not a path
    with pytest.raises(ConfigError, match=r"^train.output_dir: cannot expand '~no_such_user_xyz/runs'"):
        load_config_dict(_raw(train__output_dir="~no_such_user_xyz/runs"))


def test_every_path_key_expands_a_home_folder():
    """Each section lists its path keys in `PATHS`; a new key named like a path must be listed (or this test
    told why not)."""
    import dataclasses
    import re
    import typing

    names = re.compile(r"^(path|.*_path|.*_dir|.*_root|init_from|adapter|resume)$")
    missing, seen, todo = [], set(), [Config]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tps = [hints[f.name]]
            for tp in tps:
                tps += [a for a in typing.get_args(tp) if a not in tps]
            todo += [t for t in tps if dataclasses.is_dataclass(t)]
            if str in tps and names.match(f.name) and f.name not in getattr(cls, "PATHS", ()):
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"path keys not in their section's PATHS: {missing}"
    assert sum(len(getattr(c, "PATHS", ())) for c in seen) >= 15


def test_set_reaches_an_entry_of_an_array_of_tables_by_the_key_errors_name():
    """Errors name an entry of an array of tables `rl.rewards[0].weight`; `--set` with that key was refused as
    "rl.rewards: is a value, not a table", so changing one reward's weight meant retyping the whole list."""
    cfg = load_config(REPO / "launch/configs/demo_grpo.toml", ["rl.rewards[0].weight=0.5", "rl.rewards[0].name=em"])
    assert (cfg.rl.rewards[0].weight, cfg.rl.rewards[0].name, cfg.rl.rewards[0].type) == (0.5, "em", "exact_match")
    cfg = load_config(REPO / "launch/configs/demo_grpo.toml", ["rl.rewards.0.weight=0.75"])  # the dotted spelling
    assert cfg.rl.rewards[0].weight == 0.75
    cfg = load_config(REPO / "launch/configs/demo_grpo.toml", ["rl.rewards[0]={type = 'format', weight = 0.25}"])
    assert (cfg.rl.rewards[0].type, cfg.rl.rewards[0].weight) == ("format", 0.25)
    cfg = load_config(REPO / "launch/configs/internvl3_8b_robovqa_curriculum.toml", ["stages[1].epochs=3"])
    assert cfg.stages[1].epochs == 3.0 and cfg.stages[0].epochs == 1.0


@pytest.mark.parametrize("item, expect", [
    ("rl.rewards.1.weight=1", r"^rl.rewards\[1\]: no such entry \(the list has 1\)"),
    ("rl.rewards[1].weight=1", r"^rl.rewards\[1\]: no such entry \(the list has 1\); .*--set rl.rewards=\[\.\.\.\]"),
    ("rl.rewards.weight=1", r"^rl.rewards: a list of tables; name an entry by its index \(rl.rewards\[0\].weight\)"),
    ("rl.batch[0].group_size=4", r"^rl.batch: not a list, no entry \[0\] to set"),
    ("rl.rewards[x].weight=1", r"^--set 'rl.rewards\[x\].weight=1': expected section.key=value"),
])
def test_a_set_of_an_entry_that_does_not_exist_names_the_key(item, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(REPO / "launch/configs/demo_grpo.toml", [item])


def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path):
    """Editors on Windows save UTF-8 with a byte order mark; tomllib refuses it as "Invalid statement (at line 1,
    column 1)", an error that points at nothing the user can see."""
    import tomli_w

    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + tomli_w.dumps(_raw()).encode())
    assert load_config(path) == load_config_dict(_raw())


@pytest.mark.parametrize("text, where", [("[1, 2,, 3]", "line 1, column 7"), ("{a = }", "line 1, column 6"),
                                         ('"a" b', "line 1, column 5"), ("[1,\n2,,]", "line 2, column 3")])
def test_a_set_value_that_does_not_parse_names_the_column_within_the_value(text, where):
    """The value is parsed as `v = <value>`: the decoder's column on the first line counted those 4 characters, so
    the message pointed 4 characters past the mistake in the value it quotes."""
    with pytest.raises(ConfigError, match=rf"^train.key: --set value .* is not one TOML value \(.*\(at {where}\)\)"):
        parse_override_value(text, "train.key")
