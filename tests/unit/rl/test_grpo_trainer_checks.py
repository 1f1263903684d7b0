"""GRPO set-up checks that need no model: a missing start checkpoint names the command that makes
it (the demo's short SFT run), and the demo config's hint is that command."""
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.rl.trainer import check_model_folder

REPO = Path(__file__).resolve().parents[3]


def test_missing_model_folder_says_how_to_make_it(tmp_path):
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo.toml", [f'model.path="{tmp_path / "nope"}"'])
    with pytest.raises(FileNotFoundError, match=r"has no config.json; run the short demo SFT first: torchrun "
                                                r".*demo_sft.toml --set train.output_dir=runs/demo_sft_short"):
        check_model_folder(cfg)
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "config.json").write_text("{}")
    check_model_folder(cfg)  # present: no error


def test_missing_model_folder_without_hint(tmp_path):
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo.toml",
                      [f'model.path="{tmp_path / "nope"}"', 'rl.model_path_hint=""'])
    with pytest.raises(FileNotFoundError, match="GRPO starts from a trained model folder"):
        check_model_folder(cfg)


def _demo(tmp_path, *sets):
    (tmp_path / "config.json").write_text("{}")
    return load_config(REPO / "launch" / "configs" / "demo_grpo.toml", [f'model.path="{tmp_path}"', *sets])


def test_sync_job_refuses_fewer_prompts_than_data_parallel_ranks(tmp_path, monkeypatch):
    """Synchronous GRPO deals prompts r, r + dp, ... to data-parallel rank r: with 3 prompts over 4 ranks the last
    would train on a dummy at every step; the job stops on the mesh's size, before the prompts and engine load."""
    from types import SimpleNamespace

    from megatron_vlm import jobs
    from megatron_vlm.config import ConfigError

    cfg = _demo(tmp_path, "rl.batch.prompts_per_step=3")
    bundle = SimpleNamespace(dims=SimpleNamespace(dp_size=4), model=None, layer_kinds=None)
    monkeypatch.setattr(jobs, "build_model_bundle", lambda ctx: bundle)
    monkeypatch.setattr(jobs, "check_moe_section", lambda *a: None)

    def too_far(*a, **k):
        raise AssertionError("the prompts and rollout engine were built for a layout the job refuses")

    monkeypatch.setattr(jobs, "build_grpo_parts", too_far)
    with pytest.raises(ConfigError, match=r"^rl\.batch\.prompts_per_step: 3 prompts per step for 4 data-parallel ranks"
                                          r".*set it to >= 4"):
        jobs.run_grpo(SimpleNamespace(cfg=cfg))
    cfg = _demo(tmp_path, "rl.batch.prompts_per_step=4")  # one prompt per rank: goes on to build the parts
    with pytest.raises(AssertionError, match="rollout engine"):
        jobs.run_grpo(SimpleNamespace(cfg=cfg))


def test_refusal_reads_the_data_parallel_size_only():
    cfg = load_config(REPO / "launch" / "configs" / "demo_grpo.toml", ["rl.batch.prompts_per_step=2"])
    assert cfg.rl.data_shards_refusal(1) is None and cfg.rl.data_shards_refusal(2) is None
    assert cfg.rl.data_shards_refusal(3).startswith("rl.batch.prompts_per_step: 2 prompts per step for 3 ")
