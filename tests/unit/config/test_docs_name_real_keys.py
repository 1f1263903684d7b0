"""Every dotted config key the documentation names (README, docs/, the packages' READMEs, the comments of
launch/configs/*.toml and the config docstrings) is a key the loader accepts, so a user who copies one into a
config or a `--set` does not get an "unknown key" exit instead of what the text promised; and every
`megatron_vlm.<module>[.<name>]` it names can be imported, so a reader who looks it up finds it."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import typing
from pathlib import Path

from megatron_vlm.config import Config

REPO = Path(__file__).resolve().parents[3]
# keys named on purpose as wrong (the documented refusals of a misspelt / moved key)
DELIBERATELY_WRONG = {"optimizer.lrr", "rl.group_size"}
NOT_A_KEY_AFTER = ("/", "(", "[")  # a path (`data.x/`), a call or an index
FOREIGN_TABLES = ("verl", "TRL")  # first header cell of a table whose first column holds verl's / TRL's keys
FILE_SUFFIXES = ("sbatch", "jsonl", "json", "parquet", "py", "toml", "md", "sh", "txt", "csv", "arrow")


def _tables(cls) -> list:
    """The dataclasses a field type holds: X, Optional[X], list[X] and list[Union[X, Y]] (`[[rl.rewards]]`)."""
    out = []
    for a in (cls, *typing.get_args(cls)):
        if isinstance(a, type) and dataclasses.is_dataclass(a):
            out.append(a)
        elif typing.get_args(a):
            out += [m for m in typing.get_args(a) if isinstance(m, type) and dataclasses.is_dataclass(m)]
    return out


def config_keys() -> set[str]:
    """Every dotted key of the root config, tables included (`rl`, `rl.rollout`, `rl.rollout.weights`)."""
    keys: set[str] = set()

    def walk(prefix: str, cls) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            k = f"{prefix}.{f.name}" if prefix else f.name
            keys.add(k)
            for sub in _tables(hints[f.name]):
                walk(k, sub)

    walk("", Config)
    return keys


def _module(token: str) -> bool:
    """`data.synthetic_arith` or `checkpoint.hf.load_hf_model` name code of the package (a module, or a module's
    attribute), not a key."""
    name = "megatron_vlm." + token
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except ModuleNotFoundError:
        pass
    parent, attr = name.rsplit(".", 1)
    try:
        return hasattr(importlib.import_module(parent), attr)
    except ImportError:
        return False


def unknown_keys(text: str, where: str, keys: set[str]) -> list[str]:
    """`where:line: token` for each `<section>.<key>...` token of `text` that is neither a key, a table nor code."""
    sections = sorted({k.split(".")[0] for k in keys}, key=len, reverse=True)
    token = re.compile(r"(?<![\w./-])(?:" + "|".join(sections) + r")(?:\.[a-z_][a-z0-9_]*)+")
    bracket = re.compile(r"\[\[?((?:" + "|".join(sections) + r")(?:\.[a-z_]+)*)\]\]? (`?)([a-z_][a-z0-9_]*)`?\s*([=,;)])")
    bad, foreign = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            foreign = False
        elif line.startswith("|---"):
            pass
        elif not foreign and line.split("|")[1].strip() in FOREIGN_TABLES:
            foreign = True  # a mapping table (docs/migrating.md): its first column names the other framework's keys
            continue
        if foreign and not line.startswith("|---"):
            line = "|" + line.split("|", 2)[2]
        for m in bracket.finditer(line):
            sec, quoted, key, after = m.groups()
            if not (quoted or after == "=" or "_" in key):
                continue  # English after a table name ("the [moe] settings, ...")
            if f"{sec}.{key}" not in keys:
                bad.append(f"{where}:{n}: [{sec}] {key}")
        for m in token.finditer(line):
            t = m.group(0)
            if t in keys or t in DELIBERATELY_WRONG or t.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            if line[m.end():m.end() + 1] in NOT_A_KEY_AFTER and line[m.end():m.end() + 1]:
                continue
            if _module(t):
                continue
            bad.append(f"{where}:{n}: {t}")
    return bad


def _documents() -> list[Path]:
    docs = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
    docs += sorted((REPO / "megatron_vlm").rglob("README.md"))
    docs += sorted((REPO / "launch" / "configs").glob("*.toml"))
    return [p for p in docs if p.name != "config_reference.md"]  # generated from the docstrings, checked below


def test_documents_name_only_real_keys():
    keys = config_keys()
    assert {"rl.rollout.weights", "checkpoint.resume", "kernels.attention", "rl.batch.prompts_per_step"} <= keys
    bad = [b for p in _documents() for b in unknown_keys(p.read_text(), str(p.relative_to(REPO)), keys)]
    assert not bad, "documentation names keys the config does not have:\n" + "\n".join(bad)


def test_config_docstrings_name_only_real_keys():
    keys = config_keys()
    text = (REPO / "docs" / "config_reference.md").read_text()
    bad = unknown_keys(text, "docs/config_reference.md", keys)
    assert not bad, "config docstrings name keys the config does not have:\n" + "\n".join(bad)


def test_the_checker_sees_a_wrong_key():
    keys = config_keys()
    text = ("`rl.rollout_weights` and rl.prompts_per_step, but rl.rollout.weights, [rl.rollout], "
            "data.synthetic_arith (a module), runs/train.jsonl, launch/slurm/train.sbatch\n"
            "([rl.reward_pool] num_workers, memory_limit_mb) `[rl] rollout_backend = ...` [lora] the adapters\n")
    assert unknown_keys(text, "page.md", keys) == ["page.md:1: rl.rollout_weights", "page.md:1: rl.prompts_per_step",
                                                   "page.md:2: [rl.reward_pool] num_workers"]


def unknown_code(text: str, where: str) -> list[str]:
    """`where:line: name` for each `megatron_vlm.a.b` of `text` that is neither a module nor a module's attribute."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(r"(?<![\w/])megatron_vlm((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", line):
            name = m.group(1)[1:]
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES or _module(name):
                continue
            bad.append(f"{where}:{n}: megatron_vlm.{name}")
    return bad


def test_documents_name_only_real_code():
    bad = [b for p in _documents() for b in unknown_code(p.read_text(), str(p.relative_to(REPO)))]
    assert not bad, "documentation names modules or objects that do not exist:\n" + "\n".join(bad)
    assert unknown_code("megatron_vlm.models.nemotron_vl.tiny, megatron_vlm.checkpoint.hf.load_hf_model, "
                        "megatron_vlm.rl.env.demo_eval, megatron_vlm/rl/README.md", "p") == [
        "p:1: megatron_vlm.models.nemotron_vl.tiny"]


def test_the_other_frameworks_column_of_a_mapping_table_is_not_ours():
    text = ("| verl | megatron-vlm | notes |\n|---|---|---|\n| `data.train_batch_size` | `rl.batch.prompts_per_stepp` | "
            "`data.bogus` |\n\n| key | x |\n|---|---|\n| `data.nope` | y |\n")
    assert unknown_keys(text, "t", config_keys()) == ["t:3: rl.batch.prompts_per_stepp", "t:3: data.bogus", "t:7: data.nope"]
