"""`[dpo]` keys work in the mode that reads them or exit 2 naming the key: the section in another mode,
keys one loss variant ignores, the keys of other modes a DPO run ignores, and the preference columns."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from tests.unit.launch_in_process import run_launcher

REPO = Path(__file__).resolve().parents[3]
DPO = REPO / "launch" / "configs" / "demo_dpo.toml"
SFT = REPO / "launch" / "configs" / "demo_sft.toml"


def _check(config, *overrides):
    check_keys_for_mode(load_config(config, list(overrides)))


@pytest.mark.parametrize("overrides", [
    (), ("dpo.loss_type=\"ipo\"", "dpo.beta=0.5"), ("dpo.reference=\"on_the_fly\"",),
    ("dpo.loss_type=\"simpo\"", "dpo.simpo_gamma=1.0", "dpo.reference=\"on_the_fly\""),
    ("train.micro_batches_per_step=2", "train.eval_max_batches=2", "data.shuffle=false"),
    ("train.train_layers=[]", "lora.r=4", "lora.init_from=\"adapter\""),  # the precomputed reference: scored with it
    ("train.train_layers=[]", "lora.r=4", "lora.init_from=\"adapter\"", "lora.init_from_mode=\"merge\"",
     "dpo.reference=\"on_the_fly\""),
    ("train.train_layers=[]", "lora.r=4", "lora.init_from=\"adapter\"", "dpo.loss_type=\"simpo\"",
     "dpo.reference=\"on_the_fly\""),  # SimPO reads no reference
])
def test_dpo_accepts_its_keys(overrides):
    _check(DPO, *overrides)


@pytest.mark.parametrize("overrides, key", [
    (("dpo.simpo_gamma=1.0",), "dpo.simpo_gamma"),                                   # sigmoid ignores it
    (("dpo.loss_type=\"simpo\"", "dpo.reference=\"precomputed\""), "dpo.reference"),  # SimPO has no reference
    (("dpo.beta=0",), "dpo.beta"),
    (("dpo.loss_type=\"kto\"",), "dpo.loss_type"),
    (("dpo.label_smoothing=0.1",), "dpo.label_smoothing"),                            # not supported: unknown key
    (("train.eval_generate=false",), "train.eval_generate"),
    (("parallel.cp=2",), "parallel.cp"),
    (("rl.group_size=4",), "rl"),
    # the initial model is base + that adapter, not the adapters-off policy: refused by --check too, not only at
    # the run's start
    (("train.train_layers=[]", "lora.r=4", "lora.init_from=\"adapter\"", "dpo.reference=\"on_the_fly\""),
     "dpo.reference"),
])
def test_dpo_refuses_keys_it_ignores(overrides, key):
    with pytest.raises(ConfigError) as e:
        _check(DPO, *overrides)
    assert str(e.value).startswith(key), str(e.value)


def test_dpo_section_in_another_mode_is_refused():
    with pytest.raises(ConfigError, match=r"^dpo: the \[dpo\] section is only read when train.mode = \"dpo\""):
        _check(SFT, "dpo.beta=0.2")


@pytest.mark.parametrize("mode, columns, key", [
    ("dpo", '{prompt = "p", chosen = "c"}', "data.columns"),
    ("dpo", '{prompt = "p", chosen = "c", rejected = "r", answer = "a"}', "data.columns.answer"),
    ("dpo", '{messages = "m", chosen = "c", rejected = "r"}', "data.columns.messages"),
    ("sft", '{prompt = "p", answer = "a", chosen = "c", rejected = "r"}', "data.columns.chosen"),
    ("dpo", '{prompt = "p", chosen = "answer", rejected = "answer"}', "data.columns.rejected"),  # every pair identical
    ("dpo", '{prompt = "q", chosen = "q", rejected = "r"}', "data.columns.chosen"),  # the prompt as the response
])
def test_preference_columns(mode, columns, key):
    sets = ["data.type=\"hf\"", "data.train_path=\"x.parquet\"", f"data.columns={columns}"]
    with pytest.raises(ConfigError) as e:
        check_keys_for_mode(load_config(DPO if mode == "dpo" else SFT, sets))
    assert str(e.value).startswith(key), str(e.value)
    ok = load_config(DPO, ["data.type=\"hf\"", "data.train_path=\"x.parquet\"", "train.eval_every=0",
                           'data.columns={prompt = "p", chosen = "c", rejected = "r", images = "i"}'])
    check_keys_for_mode(ok)


def test_entry_point_exits_2_naming_the_key():
    r = run_launcher("pretrain_vlm", ["--config", DPO, "--check", "--device-memory-gib", "8", "--set",
                                      "dpo.simpo_gamma=2.0"])
    assert r.returncode == 2 and "config error: dpo.simpo_gamma:" in r.stderr, r.stderr[-2000:]
    r = run_launcher("pretrain_vlm", ["--config", DPO, "--check", "--device-memory-gib", "8"])
    assert r.returncode == 0 and "check ok: dpo run" in r.stderr + r.stdout, r.stderr[-2000:]
