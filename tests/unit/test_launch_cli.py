"""The launch scripts' command lines: `--help` shows usage and a whole first sentence, a mistyped option is
refused (exit 2) instead of silently doing the default."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch(name: str):
    sys.path.insert(0, str(REPO / "launch"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "launch"))


def test_convert_checkpoint_help_states_its_whole_first_sentence(capsys):
    conv = _launch("convert_checkpoint")
    with pytest.raises(SystemExit) as e:
        conv.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage:")
    assert "Convert a distributed training checkpoint to a Hugging Face folder (on demand; runs also export at the end)." in out


def test_gen_config_reference_help_and_a_mistyped_option(capsys, monkeypatch):
    gen = _launch("gen_config_reference")
    monkeypatch.setattr(gen, "render", lambda: "RENDERED\n")  # never touch docs/ from a test
    monkeypatch.setattr(gen, "REFERENCE", Path("/nonexistent/config_reference.md"))
    with pytest.raises(SystemExit) as e:
        gen.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--write" in out and "RENDERED" not in out
    with pytest.raises(SystemExit) as e:
        gen.main(["--wirte"])  # a typo must not print the reference and exit 0 as if the file were rewritten
    assert e.value.code == 2
    assert "RENDERED" not in capsys.readouterr().out
    gen.main([])
    assert capsys.readouterr().out == "RENDERED\n\n"
