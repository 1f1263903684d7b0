"""Context / pipeline parallel sizes that cannot work are config errors naming the key and the numbers
(exit 2 from the launcher and `--check`): cp not dividing the processes, packs not divisible into
2 x cp chunks, cp with ep, pp with tp (pp composes with dp only). GRPO takes cp (same pack-length rule)."""
from __future__ import annotations

import pytest

from megatron_vlm.config import ConfigError, load_config
from megatron_vlm.config.mode_keys import check_keys_for_mode
from megatron_vlm.parallel.mesh import build_mesh
from megatron_vlm.plan.check import CheckFailed, _layout

REPO_CFG = "launch/configs/demo_sft.toml"


def test_cp_pack_length_must_split_into_chunks():
    cfg = load_config(REPO_CFG, ["parallel.cp=2", "data.max_tokens_per_pack=1022"])
    with pytest.raises(ConfigError, match=r"parallel.cp: data.max_tokens_per_pack \(1022\).*2 x parallel.cp \(4\)"):
        check_keys_for_mode(cfg)
    check_keys_for_mode(load_config(REPO_CFG, ["parallel.cp=2", "data.max_tokens_per_pack=1024"]))


def test_cp_must_divide_processes():
    cfg = load_config(REPO_CFG, ["parallel.cp=4"])
    with pytest.raises(CheckFailed, match=r"parallel.cp: 4 does not divide the 6 ranks"):
        _layout(cfg, 6, 0)
    assert _layout(cfg, 8, 0) == (1, 2)
    with pytest.raises(ValueError, match=r"parallel.cp \(4\) must be >= 1 and divide the number of processes \(6\)"):
        build_mesh(cfg.parallel, 6, "cpu")


@pytest.mark.parametrize("sets, match", [
    (["parallel.pp=2", "parallel.tp=2"], r"parallel.pp: pipeline parallelism \(pp = 2\).*tp = 2 must be 1"),
    (["parallel.cp=2", "parallel.ep=2"], r"parallel.cp: .*cp = 2.*ep = 2"),
    (["parallel.cp=0"], r"parallel.cp: must be >= 1, got 0"),
])
def test_refused_sizes(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(REPO_CFG, sets)


def test_cp_accepted_in_grpo_with_the_pack_rule():
    grpo = "launch/configs/qwen2_5_vl_3b_geometry3k_grpo.toml"
    check_keys_for_mode(load_config(grpo, ["parallel.cp=2", "data.max_tokens_per_pack=16384"]))
    with pytest.raises(ConfigError, match=r"data.max_tokens_per_pack \(16382\).*2 x parallel.cp \(4\)"):
        check_keys_for_mode(load_config(grpo, ["parallel.cp=2", "data.max_tokens_per_pack=16382"]))
