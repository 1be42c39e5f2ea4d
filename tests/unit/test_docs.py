"""The docs' reference tables are held equal to the code they mirror, and every link resolves.

Each check reads the code (the settings dataclass, the click tree, metrics.py, the migration
files), never a list kept here, so a new setting, command, metric or revision fails this test
until its reference page says it exists. No database is needed.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import unicodedata
from pathlib import Path

import click

from orchestrator.cli import main
from orchestrator.core import config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
SOURCE_DIRS = ("orchestrator", "tests", "tasks", "config", "bench")


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])])
    return rows


def _first_code(cell: str) -> str | None:
    found = re.search(r"`([^`]*)`", cell)
    return found.group(1) if found else None


# ------------------------------------------------------------------------------ settings


def _default_forms(value: object) -> set[str]:
    """How a default may be written in the table."""
    if value == "" or value == ():
        return set()
    if isinstance(value, bool):
        return {"true" if value else "false"}
    if isinstance(value, tuple):
        return {",".join(str(v) for v in value)}
    if isinstance(value, float):
        forms = {repr(value)}
        if value.is_integer():
            forms.add(str(int(value)))
        return forms
    return {str(value)}


def test_every_setting_is_documented_with_its_default() -> None:
    rows = _table_rows((REFERENCE / "settings.md").read_text())
    documented = {}
    for row in rows:
        name = _first_code(row[0]) if row else None
        if name and name.startswith(config.PREFIX) and len(row) >= 2:
            documented[name] = row[1]
    fields = {config.PREFIX + f.name.upper(): f for f in dataclasses.fields(config.Settings)}
    missing = sorted(set(fields) - set(documented))
    assert not missing, f"settings.md lacks {missing}"
    for name, f in fields.items():
        cell = documented[name]
        default = f.default
        assert default is not dataclasses.MISSING, f"{name}: no plain default"
        forms = _default_forms(default)
        if not forms:  # empty string or empty tuple: the table says "unset"
            assert cell.startswith("unset"), f"{name}: default is unset in the code, the table says {cell!r}"
        else:
            shown = _first_code(cell)
            assert shown in forms, f"{name}: default {default!r} in the code, the table says {cell!r}"


def test_no_variable_is_documented_that_does_not_exist() -> None:
    """Every ORCHESTRATOR_* name in README and docs is a setting or is read somewhere in the code."""
    fields = {config.PREFIX + f.name.upper() for f in dataclasses.fields(config.Settings)}
    source = "\n".join(
        p.read_text(errors="replace") for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if p.name != "test_docs.py"
    )
    for path in MARKDOWN:
        for name in set(re.findall(r"\bORCHESTRATOR_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
            assert name in fields or name in source, f"{path.relative_to(ROOT)} documents {name}, which nothing reads"
    table = {
        _first_code(r[0])
        for r in _table_rows((REFERENCE / "settings.md").read_text())
        if r and (_first_code(r[0]) or "").startswith(config.PREFIX)
    }
    assert fields <= table


# ------------------------------------------------------------------------------ CLI


def _commands(group: click.Command, path: tuple[str, ...] = ()) -> set[str]:
    found = {" ".join(path)} if path else set()
    if isinstance(group, click.Group):
        for name, cmd in group.commands.items():
            found |= _commands(cmd, (*path, name))
    return found


def test_every_command_has_a_heading_and_every_heading_a_command() -> None:
    text = (REFERENCE / "cli.md").read_text()
    headings = set(re.findall(r"^#{2,4} `orchestrator ([a-z][a-z -]*?)`\s*$", text, flags=re.M))
    commands = _commands(main)
    assert not commands - headings, f"cli.md lacks {sorted(commands - headings)}"
    assert not headings - commands, f"cli.md documents commands that do not exist: {sorted(headings - commands)}"


# ------------------------------------------------------------------------------ metrics


def _exported_metrics() -> set[str]:
    """Every metric family name metrics.py builds: the string literals that are whole names."""
    tree = ast.parse((ROOT / "orchestrator" / "web" / "metrics.py").read_text())
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"orchestrator_[a-z0-9_]+", node.value)
    }


def test_metrics_reference_matches_the_code() -> None:
    exported = _exported_metrics()
    assert len(exported) >= 10, "found too few metric names in metrics.py: did it stop naming them literally?"
    text = (REFERENCE / "metrics.md").read_text()
    named = set(re.findall(r"`(orchestrator_[a-z0-9_]+)`", text))
    assert not exported - named, f"metrics.md lacks {sorted(exported - named)}"
    assert not named - exported, f"metrics.md names metrics that metrics.py does not export: {sorted(named - exported)}"


# ------------------------------------------------------------------------------ migrations


def test_every_revision_is_listed() -> None:
    text = (REFERENCE / "migrations.md").read_text()
    listed = {_first_code(r[0]) for r in _table_rows(text) if r}
    revisions = set()
    for path in sorted((ROOT / "orchestrator" / "store" / "migrations" / "versions").glob("*.py")):
        found = re.search(r'^revision\s*=\s*["\']([^"\']+)["\']', path.read_text(), flags=re.M)
        if found is None:
            continue
        revisions.add(found.group(1))
        assert found.group(1) in listed, f"migrations.md does not list revision {found.group(1)} ({path.name})"
    assert revisions, "no revision files found"
    stale = {r for r in listed if r and re.fullmatch(r"\d{4}", r)} - revisions
    assert not stale, f"migrations.md lists revisions that do not exist: {sorted(stale)}"


# ------------------------------------------------------------------------------ links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = _slug(heading.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_resolves() -> None:
    for path in MARKDOWN:
        for link in _links(path):
            if re.match(r"[a-z]+:", link):
                continue  # http:, https:, mailto:
            target, _, anchor = link.partition("#")
            dest = (path.parent / target).resolve() if target else path
            where = f"{path.relative_to(ROOT)} links to {link}"
            assert dest.exists(), f"{where}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{where}: no such heading"


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    # CI runs the README's test command: `pytest` in a fenced block under a heading about tests
    section = re.search(r"^#+ [^\n]*[Tt]est[^\n]*\n(.*?)(?=^#+ |\Z)", text, flags=re.M | re.S)
    assert section is not None and re.search(r"```(?:bash)?\npytest\n```", section.group(1))
