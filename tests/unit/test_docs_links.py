"""Every relative link of the repository's markdown (README, docs/, the packages' READMEs) points at a file or
folder that exists, and the README stays a one-screen entry page that links to docs/ for the rest."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [REPO / p for p in out.stdout.splitlines() if (REPO / p).is_file()]
    return [p for p in REPO.rglob("*.md") if ".git" not in p.parts]


def _links(path: Path):
    """(line number, target) of each link of `path` outside code fences."""
    fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in LINK.findall(line):
            yield n, target


def broken_links(path: Path) -> list[str]:
    """`path:line: target` for each relative link whose target is not there (web links and anchors aside)."""
    bad = []
    for n, target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(f"{path.relative_to(REPO)}:{n}: {target}")
    return bad


def test_relative_links_resolve():
    files = _markdown_files()
    assert REPO / "README.md" in files
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "links to missing files:\n" + "\n".join(bad)


def test_the_checker_sees_a_broken_link(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [web](https://example.org) [anchor](#x) [gone](missing.md#y)\n```\n[code](no.md)\n```\n")
    assert broken_links(page) == ["page.md:1: missing.md#y"]


def test_readme_fits_on_a_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def split_tables(path: Path) -> list[str]:
    """`path:line` for each table row that follows a blank line after a table without a header of its own: markdown
    ends the table at the blank line and prints the rows after it as text."""
    lines, bad, fence = path.read_text().splitlines(), [], False
    for n, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("|") or n < 2 or lines[n - 1].strip():
            continue
        header = n + 1 < len(lines) and re.match(r"^\|\s*:?-+", lines[n + 1])
        if lines[n - 2].startswith("|") and not header:
            bad.append(f"{path.relative_to(REPO)}:{n + 1}")
    return bad


def test_tables_are_not_split_by_a_blank_line(tmp_path, monkeypatch):
    bad = [b for f in _markdown_files() for b in split_tables(f)]
    assert not bad, "table rows after a blank line (rendered as text):\n" + "\n".join(bad)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n\n| c | d |\n|---|---|\n| 5 | 6 |\n")
    assert split_tables(page) == ["page.md:5"]


def readme_section(title: str) -> list[str]:
    """The lines of the README's `## <title>` section."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def test_every_docs_page_has_a_row_in_the_readme_index():
    """The README's "Documentation" table is where a reader looks for a topic: a page under docs/ without a row
    there is found only by chance (a link in passing elsewhere does not count)."""
    rows = [line for line in readme_section("Documentation") if line.startswith("| [")]
    linked = {target.split("#", 1)[0] for row in rows for target in LINK.findall(row.split("|")[1])}
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages without a row in README.md's Documentation table: {sorted(pages - linked)}"


def test_every_subpackage_has_a_row_in_the_readme_package_table():
    """The README's package table ("Map of the code") names every sub-package of megatron_vlm/, so that no part of
    the code is missing from the map (megatron_vlm/kernels is the kernels/ folder: its row is `kernels/`)."""
    first_cells = " ".join(line.split("|")[1] for line in readme_section("Map of the code") if line.startswith("| `"))
    named = set(re.findall(r"`([^`]+)`", first_cells))
    packages = {p.name for p in (REPO / "megatron_vlm").iterdir()
                if p.is_dir() and (p / "__init__.py").exists() and not p.is_symlink()}
    missing = sorted(p for p in packages if f"megatron_vlm/{p}/" not in named)
    assert not missing, f"sub-packages without a row in README.md's package table: {missing}"
    assert "kernels/" in " ".join(named)


def test_every_kernel_backend_folder_is_named_in_the_kernels_row():
    """The `kernels/` row of the README's package table lists the op library's folders (one backend family each)."""
    row = next(line for line in readme_section("Map of the code") if line.startswith("| `kernels/`"))
    named = set(re.findall(r"`([a-z_]+)/`", row.split("|")[2]))
    folders = {p.name for p in (REPO / "kernels").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - named == set(), f"kernels/ folders the README's kernels row does not name: {sorted(folders - named)}"


def test_every_demo_config_is_listed_in_demo_and_tests():
    """The README sends a reader to docs/demo_and_tests.md for "the other demos": each demo config in
    launch/configs/ is named there, with the page that has its commands and figures."""
    page = (REPO / "docs" / "demo_and_tests.md").read_text()
    named = set(re.findall(r"`(demo_[a-z0-9_]+\.toml)`", page))
    demos = {p.name for p in (REPO / "launch" / "configs").glob("demo_*.toml")}
    assert demos - named == set(), f"demo configs docs/demo_and_tests.md does not list: {sorted(demos - named)}"


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but `-` / `_` dropped, spaces as `-`,
    a repeated heading suffixed `-1`, `-2`, ..."""
    anchors, seen, fence = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_anchors(path: Path) -> list[str]:
    """`path:line: target` for each link to `page.md#anchor` (or `#anchor`) whose page has no such heading."""
    bad = []
    for n, target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        page, anchor = target.split("#", 1)
        page_path = path.parent / page if page else path
        if page_path.suffix == ".md" and page_path.is_file() and anchor not in heading_anchors(page_path):
            bad.append(f"{path.relative_to(REPO)}:{n}: {target}")
    return bad


def test_anchors_name_a_heading(tmp_path, monkeypatch):
    bad = [b for f in _markdown_files() for b in broken_anchors(f)]
    assert not bad, "links to headings that are not there:\n" + "\n".join(bad)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "ref.md").write_text("## [rl.env]\n## Multi-turn rollouts (`[rl.env]`)\n## Notes\n## Notes\n")
    page = tmp_path / "page.md"
    page.write_text("[a](ref.md#rlenv) [b](ref.md#multi-turn-rollouts-rlenv) [c](ref.md#notes-1) [d](#top)\n"
                    "# Top\n[e](ref.md#rl.env) [f](ref.md#notes-2)\n")
    assert broken_anchors(page) == ["page.md:3: ref.md#rl.env", "page.md:3: ref.md#notes-2"]
