"""The launch command lines the documentation shows (README, docs/, the packages' READMEs and the comment headers
of launch/configs/*.toml) name a config that exists and `--set` overrides it accepts, so a copied command does
not stop at "unknown key" or a missing file."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.config.loader import ConfigError

REPO = Path(__file__).resolve().parents[3]
ENTRY_POINTS = ("launch/pretrain_vlm.py", "launch/evaluate.py", "launch/slurm/train.sbatch")


def _documents() -> list[Path]:
    docs = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
    docs += sorted((REPO / "megatron_vlm").rglob("README.md"))
    return docs + sorted((REPO / "launch" / "configs").glob("*.toml"))


def commands(text: str, toml: bool = False) -> list[tuple[str, list[str]]]:
    """(config path, --set / --unset overrides) of every documented launch line of `text`: continuation lines joined,
    placeholders (`x.toml`, `<...>`, `...`) left out."""
    if toml:  # a config's comment lines
        text = "\n".join(line[1:].strip() if line.startswith("#") else "" for line in text.splitlines())
    text = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in text.splitlines():
        start = min((line.find(e) for e in ENTRY_POINTS if e in line), default=-1)
        if start < 0 or "--config" not in line and "train.sbatch" not in line:
            continue
        seg = re.split(r"`|\s#\s|\s{2,}#", line[start:])[0]
        try:
            toks = shlex.split(seg)
        except ValueError:
            continue
        config, sets = None, []
        for i, t in enumerate(toks[:-1]):
            if t == "--config":
                config = toks[i + 1]
            elif t == "--set":
                sets.append(toks[i + 1])
            elif t == "--unset":  # as launch/pretrain_vlm.py passes it on
                sets.append("~" + toks[i + 1])
        if config is None and toks[0].endswith("train.sbatch") and len(toks) > 1:
            config = toks[1]
        if not config or not config.endswith(".toml") or Path(config).name in ("x.toml", "eval.toml") or "<" in config:
            continue
        out.append((config, [s for s in sets if "<" not in s and "..." not in s]))
    return out


def _all_commands() -> list[tuple[str, str, list[str]]]:
    return [(str(p.relative_to(REPO)), c, s) for p in _documents()
            for c, s in commands(p.read_text(), toml=p.suffix == ".toml")]


def test_the_documents_show_commands():
    found = _all_commands()
    assert len(found) > 40
    assert any(c == "launch/configs/demo_sft.toml" for _, c, _ in found)


@pytest.mark.parametrize("where, config, sets", _all_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_documented_command_loads(where, config, sets):
    path = REPO / config
    assert path.is_file(), f"{where}: {config} does not exist"
    try:
        load_config(path, sets)
    except (ConfigError, SystemExit) as e:
        pytest.fail(f"{where}: --config {config} {' '.join('--set ' + s for s in sets)}: {e}")


def test_the_parser_reads_continued_lines_and_skips_placeholders():
    text = ("```bash\ntorchrun --nproc_per_node 2 launch/pretrain_vlm.py --config launch/configs/demo_sft.toml \\\n"
            "    --set train.max_steps=100 --set 'rl.rewards=[{type = \"math\"}]'  # a comment\n"
            "python launch/pretrain_vlm.py --config x.toml --check\n"
            "sbatch launch/slurm/train.sbatch launch/configs/demo_sft.toml --set train.output_dir=<dir>\n```\n")
    assert commands(text) == [("launch/configs/demo_sft.toml", ["train.max_steps=100", 'rl.rewards=[{type = "math"}]']),
                              ("launch/configs/demo_sft.toml", [])]
    assert commands("#   python launch/pretrain_vlm.py --config launch/configs/demo_dpo.toml\nx = 1\n", toml=True) == [
        ("launch/configs/demo_dpo.toml", [])]
    assert commands("python launch/pretrain_vlm.py --config launch/configs/demo_sft.toml --unset train.max_steps "
                    "--set train.epochs=1") == [("launch/configs/demo_sft.toml", ["~train.max_steps", "train.epochs=1"])]
