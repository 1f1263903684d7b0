"""The Hugging Face export is never written in place: a full disk (or a crash) while writing a new
export leaves the previous one byte for byte, with no temporary folder left; a successful export
replaces the old weights (stale shards gone), keeps the folder's other files, and ends with its
marker."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from megatron_vlm.checkpoint import hf as hf_mod
from megatron_vlm.checkpoint.hf import save_hf_model
from megatron_vlm.models import build_model
from tests.fixtures import tiny_qwen2_5_vl as F


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(F.tiny_qwen2_5_vl_config_dict())


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_disk_full_while_exporting_keeps_the_previous_export(tmp_path, model, monkeypatch):
    out = tmp_path / "hf"
    save_hf_model(model, out, max_shard_size="100KB")
    before = _files(out)
    written = []
    real = hf_mod.save_file

    def fill_the_disk(tensors, filename, metadata=None):
        if written:  # the second shard no longer fits
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        written.append(filename)
        return real(tensors, filename, metadata=metadata)

    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    monkeypatch.setattr(hf_mod, "save_file", fill_the_disk)
    with pytest.raises(OSError, match="No space left"):
        save_hf_model(model, out, max_shard_size="100KB")
    monkeypatch.undo()
    with torch.no_grad():
        next(model.parameters()).sub_(1.0)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary / old folder left


def test_export_replaces_weights_keeps_other_files_and_marks_complete(tmp_path, model):
    out = tmp_path / "hf"
    save_hf_model(model, out, max_shard_size="100KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    (out / "tokenizer_config.json").write_text("{}")  # e.g. a processor written there first
    save_hf_model(model, out)  # one file this time
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not any(n.startswith("model-") for n in names)
    assert "model.safetensors.index.json" not in names
    assert "tokenizer_config.json" in names and hf_mod.EXPORT_MARKER in names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_after_a_kill_between_the_two_renames(tmp_path, model):
    """Killed after moving the previous export aside and before renaming the new one into place:
    the previous export is `.hf.old`; the next export completes normally and keeps its other files."""
    out = tmp_path / "hf"
    save_hf_model(model, out)
    (out / "tokenizer_config.json").write_text("{}")
    out.rename(tmp_path / ".hf.old")
    save_hf_model(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "tokenizer_config.json").is_file() and (out / "model.safetensors").is_file()


def test_export_never_keeps_files_of_an_earlier_export(tmp_path, model):
    """A merged export into a folder that held an adapter export (or another model's export) drops that
    export's adapter files and generation config: transformers + peft would apply the LoRA a second time on
    the merged weights, and a stale generation config would be used silently. Other files stay."""
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "generation_config.json",
                 "pytorch_model.bin", "README.md"):
        (out / name).write_text("{}")
    assert getattr(model, "hf_generation_config", None) is None
    save_hf_model(model, out)
    names = {p.name for p in out.iterdir()}
    assert not names & {"adapter_config.json", "adapter_model.safetensors", "generation_config.json", "pytorch_model.bin"}
    assert {"README.md", "model.safetensors", "config.json"} <= names


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_are_readable_as_the_umask_allows(tmp_path, model, umask):
    """safetensors creates files 0600; the export's files get 0666 less the umask (0644 by default), so a
    group sharing the folder can read the weights."""
    old = os.umask(umask)
    try:
        save_hf_model(model, tmp_path / "hf", max_shard_size="100KB")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_export_to_a_symlinked_folder_replaces_the_folder_it_names(tmp_path, model):
    """`hf` a symlink to a folder elsewhere (shared storage): the export replaces that folder and the link stays.
    It used to replace the link itself by a new folder beside it, leave the target stale and a dangling
    `.hf.old` link behind."""
    target = tmp_path / "shared" / "hf"
    save_hf_model(model, target)
    (target / "tokenizer_config.json").write_text("{}")
    before = (target / "model.safetensors").read_bytes()
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "hf"
    link.symlink_to(target)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    try:
        save_hf_model(model, link)
    finally:
        with torch.no_grad():
            next(model.parameters()).sub_(1.0)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["hf"]
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["hf"]
    assert (target / "tokenizer_config.json").is_file() and (target / hf_mod.EXPORT_MARKER).is_file()
    assert (target / "model.safetensors").read_bytes() != before  # the new weights


def test_export_onto_a_file_is_refused_before_writing(tmp_path, model, monkeypatch):
    out = tmp_path / "hf"
    out.write_text("not a folder")
    monkeypatch.setattr(hf_mod, "save_file", lambda *a, **k: pytest.fail("wrote weights for an export it refuses"))
    with pytest.raises(NotADirectoryError, match="not a folder"):
        save_hf_model(model, out)
    assert out.read_text() == "not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_with_copy_from_keeps_no_tokenizer_files_of_an_earlier_export(tmp_path, model):
    """An export copying the tokenizer / processor files of `copy_from` into a folder that held another model's
    export drops that export's tokenizer / processor files the source lacks: a stale chat_template.jinja wins over
    the tokenizer_config.json template in transformers, a stale preprocessor_config.json makes a text model's folder
    look like a vision model's. Other files stay."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer_config.json").write_text('{"chat_template": "NEW"}')
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("chat_template.jinja", "preprocessor_config.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        (out / name).write_text("OLD")
    (out / "README.md").write_text("notes")
    save_hf_model(model, out, copy_from=src)
    names = {p.name for p in out.iterdir()}
    assert not names & {"chat_template.jinja", "preprocessor_config.json", "vocab.json", "merges.txt"}, names
    assert (out / "tokenizer_config.json").read_text() == '{"chat_template": "NEW"}'
    assert {"README.md", "tokenizer.json", "model.safetensors", "config.json"} <= names
