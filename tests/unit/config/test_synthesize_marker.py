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
