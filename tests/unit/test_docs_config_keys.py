"""Every config key the prose names is a key of the schema, and a value written beside it is one its type takes.

The README, docs/ and the packages' READMEs name keys in backticks: `train.max_steps`, `parallel.fsdp = false`,
`[rl] rollout_backend = "vllm"`, and inside the RL pages relative to `[rl]` (`batch.group_size`); commands name
them in `--set key=value` / `--unset key`, and ```toml examples hold whole fragments. A renamed or
removed key leaves such a sentence telling users to set something the strict loader refuses (exit 2), so each is
resolved against the config dataclasses here. Not checked: docs/migrating.md's tables (the other frameworks' keys
stand beside ours there; test_migrating_doc.py checks our column), module paths that share a section's name
(`kernels.reference.norms.rms_norm`, `rl.rewards.score_model.save_score_model`: they import), placeholders
(`parallel.tp = N`), and the meaning of a value beyond its type (the loader's own tests do that).
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import typing
from pathlib import Path

import pytest
import tomllib

from megatron_vlm.config import Config
from tests.unit.test_migrating_doc import REGISTRIES, _members, resolve

REPO = Path(__file__).resolve().parents[2]
TOP = tuple(f.name for f in dataclasses.fields(Config))
_RL = _members(typing.get_type_hints(Config)["rl"])[0]
# [rl]'s tables that are no top-level section: `batch.group_size` in prose is rl.batch.group_size
RL_TABLES = tuple(f.name for f in dataclasses.fields(_RL) if f.name not in TOP
                  and any(dataclasses.is_dataclass(m) for m in _members(typing.get_type_hints(_RL)[f.name])))
SPAN = re.compile(r"`([^`]+)`")
DOTTED = r"[a-z_][a-z_0-9]*(?:\[\w*\])?(?:\.[a-z_0-9]+(?:\[\w*\])?)+"
KEY = re.compile(rf"^(?P<key>{DOTTED})(?:\s*=\s*(?P<value>.+))?$")
TABLE_KEY = re.compile(r"^\[\[?(?P<table>[a-z_.]+)\]\]?\s+(?P<key>[a-z_0-9]+)(?:\s*=\s*(?P<value>.+))?$")


def _pages() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True)
    names = out.stdout.split() if out.returncode == 0 and out.stdout.strip() else [
        str(p.relative_to(REPO)) for p in REPO.rglob("*.md") if ".git" not in p.parts]
    # the changelog records what was; RESULTS.md quotes the settings of past runs
    return [REPO / n for n in names if not n.startswith(("CHANGELOG", "benchmarks/")) and (REPO / n).is_file()]


def _is_module_path(dotted: str) -> bool:
    """`kernels.reference.norms.rms_norm`: a module (and attribute) under megatron_vlm, not a config key."""
    parts = ["megatron_vlm", *dotted.split(".")]
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return i > 2  # megatron_vlm.kernels alone is the [kernels] section too
    return False


def _takes(leaf, value) -> bool:
    if typing.get_origin(leaf) is typing.Literal:
        return value in typing.get_args(leaf)
    if dataclasses.is_dataclass(leaf) or typing.get_origin(leaf) is dict or leaf is dict:
        return isinstance(value, dict)
    if leaf is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if leaf is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(leaf, type) and isinstance(value, leaf)


def _accepts(key: str, leaves: list, value) -> bool:
    if key in REGISTRIES:
        return value in REGISTRIES[key]
    if isinstance(value, list):  # list[...] annotations resolve to their element type
        return all(_accepts(key, leaves, v) for v in value)
    return any(_takes(leaf, value) for leaf in leaves)


def _values(text: str):
    """The TOML values of `a = 1` or `a = "x" | "y"` (alternatives); None for a placeholder (`N`, `k`)."""
    out = []
    for alt in [text] if "|" not in text else text.split("|"):
        try:
            out.append(tomllib.loads(f"v = {alt.strip()}")["v"])
        except tomllib.TOMLDecodeError:
            return None
    return out


def _moved(key: str) -> bool:
    """rl.group_size: a key of an older layout that the loader refuses naming where it moved (a section's MOVED)."""
    parent, _, name = key.rpartition(".")
    try:
        return any(name in getattr(cls, "MOVED", {}) for cls in resolve(parent))
    except KeyError:
        return False


def span_problems(span: str, line: str = "") -> list[str]:
    """What is wrong with one backticked span, if it names a config key ([] when it does not name one). A moved key
    may be named on a `line` that says it moved."""
    span = span.strip()
    m = TABLE_KEY.match(span)
    if m and m["table"].split(".")[0] in TOP:
        key, value = f"{m['table']}.{m['key']}", m["value"]
    else:
        m = KEY.match(span)
        if not m or m["key"].split(".")[0].split("[")[0] not in TOP + RL_TABLES:
            return []
        key, value = m["key"], m["value"]
    key = re.sub(r"\[\w*\]", "", key)  # rl.rewards[i].function: an entry of an array of tables
    key = ".".join(p for p in key.split(".") if not p.isdigit())  # --set rl.rewards.0.weight
    if key.split(".")[0] in RL_TABLES:
        key = f"rl.{key}"
    if key.split(".")[-1] in ("py", "md", "toml", "json", "jsonl", "csv", "txt"):
        return []  # a file name (`batch.py`)
    try:
        leaves = resolve(key)
    except KeyError:
        if _is_module_path(key) or key.startswith("rl.rollout.n"):  # verl's rollout.n, quoted beside ours
            return []
        if _moved(key) and "moved" in line:
            return []
        return [f"`{span}`: {key} is not a config key"]
    values = _values(value) if value is not None else []
    for v in values or []:
        if not _accepts(key, leaves, v):
            return [f"`{span}`: {key} does not take {v!r}"]
    return []


OVERRIDE = re.compile(r"--(?:set|unset)[ =]([a-z_][a-z_0-9.\[\]]*)")


def override_problems(line: str) -> list[str]:
    """The keys of the `--set key=value` / `--unset key` items of a command line (in prose or a code block)."""
    bad = []
    for key in OVERRIDE.findall(line):
        if key.split(".")[0].split("[")[0] in TOP:  # `--set section.key=value` is a placeholder
            bad += [p for p in span_problems(key) if "not a config key" in p]
    return bad


def page_problems(path: Path) -> list[str]:
    bad, fence = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        bad += [f"{path.relative_to(REPO)}:{n}: {p}" for p in override_problems(line)]
        if line.startswith("```"):
            fence = not fence
        if fence or (path.name == "migrating.md" and line.startswith("|")):
            continue
        for span in SPAN.findall(line):
            bad += [f"{path.relative_to(REPO)}:{n}: {p}" for p in span_problems(span, line)]
    return bad


def test_every_key_the_docs_name_exists_and_takes_its_value():
    pages = _pages()
    assert REPO / "README.md" in pages and REPO / "docs" / "training.md" in pages
    bad = [b for page in pages for b in page_problems(page)]
    assert not bad, "config keys in the docs that the schema does not have or whose value it refuses:\n" + "\n".join(bad)


@pytest.mark.parametrize("span, expect", [
    ("train.max_step", "train.max_step is not a config key"),
    ("parallel.fsdp = \"yes\"", "parallel.fsdp does not take 'yes'"),
    ("[train] mode = \"ppo\"", "train.mode does not take 'ppo'"),
    ("rl.group_size", "rl.group_size is not a config key"),
    ("[[rl.rewards]] functon", "rl.rewards.functon is not a config key"),
    ("batch.group_sise", "rl.batch.group_sise is not a config key"),
    ("rl.rollout.cuda_graphs = \"auto\" | 1", "does not take 1"),
    ("rl.policy_loss = \"sapo\"", "does not take 'sapo'"),
    ("train.train_layers = [1]", "does not take [1]"),
])
def test_the_checker_sees_a_wrong_key_or_value(span, expect):
    assert expect in " ".join(span_problems(span))


def test_the_checker_sees_a_wrong_override_key():
    assert override_problems("launch/pretrain_vlm.py --config x.toml --set train.max_steps=2 --unset train.epochs") == []
    assert override_problems("--set section.key=value --unset section.key") == []
    assert override_problems("--set train.max_step=2") == ["`train.max_step`: train.max_step is not a config key"]
    assert override_problems("--unset=lora.rr") == ["`lora.rr`: lora.rr is not a config key"]


@pytest.mark.parametrize("span", [
    "train.max_steps", "parallel.fsdp = false", "[rl] rollout_backend = \"vllm\"", "rl.rollout.memory_gib = 24",
    "train.train_layers = [\"^visual\\\\.merger\\\\.\"]", "rl.rewards[0].function", "rl.rewards.0.weight",
    "batch.group_size", "parallel.tp = N", "kernels.reference.norms.rms_norm", "advantages.py", "torch.compile",
])
def test_the_checker_takes_a_right_span(span):
    assert span_problems(span) == []


def toml_block_problems(block: str) -> list[str]:
    """What is wrong with one ```toml example: it must parse, and each of its keys exist and take its value."""
    try:
        doc = tomllib.loads(block)
    except tomllib.TOMLDecodeError as e:
        return [f"does not parse: {e}"]
    bad: list[str] = []

    def walk(table: dict, prefix: str) -> None:
        for name, value in table.items():
            key = f"{prefix}.{name}" if prefix else name
            try:
                leaves = resolve(key)
            except KeyError:
                bad.append(f"{key} is not a config key")
                continue
            if isinstance(value, dict) and any(dataclasses.is_dataclass(leaf) for leaf in leaves):
                walk(value, key)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for entry in value:  # an array of tables ([[rl.rewards]])
                    walk(entry, key)
            elif not _accepts(key, leaves, value):
                bad.append(f"{key} does not take {value!r}")

    walk(doc, "")
    return bad


def test_every_toml_example_in_the_docs_is_a_valid_config_fragment():
    bad, blocks = [], 0
    for page in _pages():
        text = page.read_text()
        for m in re.finditer(r"^```toml\n(.*?)^```", text, re.S | re.M):
            blocks += 1
            line = text[: m.start()].count("\n") + 1
            bad += [f"{page.relative_to(REPO)}:{line}: {p}" for p in toml_block_problems(m.group(1))]
    assert blocks >= 5
    assert not bad, "TOML examples in the docs that the config refuses:\n" + "\n".join(bad)


def test_the_toml_checker_sees_a_wrong_example():
    assert toml_block_problems('[train]\nmode = "dpo"\n[dpo]\nbeta = 0.1\n[[rl.rewards]]\ntype = "math"\n') == []
    assert toml_block_problems("[train]\nmax_step = 2\n") == ["train.max_step is not a config key"]
    assert toml_block_problems('[[rl.rewards]]\ntype = "math"\nwieght = 1.0\n') == ["rl.rewards.wieght is not a config key"]
    assert toml_block_problems('[parallel]\nfsdp = "yes"\n') == ["parallel.fsdp does not take 'yes'"]
    assert toml_block_problems("[train\n")[0].startswith("does not parse")
