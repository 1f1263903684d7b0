"""`model.synthesize` at a path that holds another tiny model built there is refused with the key named (the run
would have trained the model that is there, not the one the config asks for); the same name, or a folder not
built by `synthesize` (a real checkpoint), is used as it is."""
from types import SimpleNamespace

import pytest

from megatron_vlm.config import ConfigError
from megatron_vlm.plan.check import CheckFailed, _read_model_config
from megatron_vlm.runner import _prepare_model_folder
from megatron_vlm.testing.synthesize import MARKER, synthesize_model_folder, synthesized_mismatch


def _cfg(path, name):
    return SimpleNamespace(model=SimpleNamespace(path=str(path), synthesize=name), train=SimpleNamespace(seed=0))


def test_another_tiny_model_at_the_path_is_refused(tmp_path):
    folder = synthesize_model_folder("tiny_qwen3", tmp_path / "m", seed=0)
    assert (folder / MARKER).is_file()
    env = SimpleNamespace(is_main=True)
    _prepare_model_folder(_cfg(folder, "tiny_qwen3"), env)  # the same one: used
    assert _read_model_config(_cfg(folder, "tiny_qwen3"))["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match=r"^model\.synthesize: 'tiny_qwen2' but model\.path .* 'tiny_qwen3'"):
        _prepare_model_folder(_cfg(folder, "tiny_qwen2"), env)
    with pytest.raises(CheckFailed, match=r"^model\.synthesize: 'tiny_qwen2' but"):
        _read_model_config(_cfg(folder, "tiny_qwen2"))


def test_a_folder_not_built_here_is_used_as_it_is(tmp_path):
    folder = synthesize_model_folder("tiny_qwen3", tmp_path / "m", seed=0)
    (folder / MARKER).unlink()  # a real checkpoint has no marker
    assert synthesized_mismatch("tiny_qwen2", folder) is None
    _prepare_model_folder(_cfg(folder, "tiny_qwen2"), SimpleNamespace(is_main=True))
    (folder / MARKER).write_text("not json")
    assert synthesized_mismatch("tiny_qwen2", folder) is None


def test_two_jobs_building_one_tiny_model_at_once_both_go_on(tmp_path, monkeypatch):
    """Demo configs share their tiny model folder (demo_sft / demo_dpo / demo_reward_model: tiny-qwen2.5-vl); two of
    them started at once on a fresh checkout both built it through one fixed `<path>.tmp`, and the second's rename
    failed ("Directory not empty": a traceback on rank 0). Here the other job finishes while this one builds."""
    from megatron_vlm.testing import synthesize

    target = tmp_path / "m"
    real = synthesize.SYNTHESIZERS["tiny_qwen3"]

    def other_job_finishes_first(out, seed):
        if not target.exists():  # the other job, which started first, puts its folder in place
            real(tmp_path / "other", seed).rename(target)
        return real(out, seed)

    monkeypatch.setitem(synthesize.SYNTHESIZERS, "tiny_qwen3", other_job_finishes_first)
    assert synthesize_model_folder("tiny_qwen3", target, seed=0) == target
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no build folder left behind


def test_a_folder_of_other_files_at_the_path_is_a_config_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"^model.path: cannot build the tiny model 'tiny_qwen3' at .*: point"):
        synthesize_model_folder("tiny_qwen3", tmp_path / "m", seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
