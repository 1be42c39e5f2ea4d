"""``docs/design.md``'s module map names every module of the package and none that does not exist.

An entry is a path in backticks in the first cell of a row of the map's tables: a file
(``orchestrator/core/states.py``), a folder (``orchestrator/web/views/``: everything under it) or a
glob (``orchestrator/store/sql/*.sql``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
ENTRY = re.compile(r"^\|\s*`(orchestrator/[^`]*)`")


def map_entries() -> list[str]:
    text = DESIGN.read_text()
    start = text.index("## Module map")
    end = text.index("\n## ", start + 1)
    return [m.group(1) for line in text[start:end].splitlines() if (m := ENTRY.match(line))]


def modules() -> list[str]:
    """Every Python module of the package (a migration revision is covered by its folder's entry)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "orchestrator").rglob("*.py"))


def covers(entry: str, path: str) -> bool:
    if entry.endswith("/"):
        return path.startswith(entry)
    if "*" in entry:
        return Path(path).match(entry)
    return path == entry


def test_every_module_is_on_the_map() -> None:
    entries = map_entries()
    missing = [m for m in modules() if not any(covers(e, m) for e in entries)]
    assert not missing, f"docs/design.md's module map misses {missing}"


def test_every_entry_of_the_map_exists() -> None:
    stale = []
    for entry in map_entries():
        if "*" in entry:
            found = list(ROOT.glob(entry))
        else:
            found = [ROOT / entry] if (ROOT / entry).exists() else []
        if not found:
            stale.append(entry)
    assert not stale, f"docs/design.md's module map names what does not exist: {stale}"


def test_no_module_is_listed_twice() -> None:
    entries = [e for e in map_entries() if not e.endswith("/") and "*" not in e]
    twice = sorted({e for e in entries if entries.count(e) > 1})
    assert not twice, twice


def test_the_checker_sees_a_missing_and_a_stale_entry() -> None:
    assert covers("orchestrator/web/views/", "orchestrator/web/views/runs.py")
    assert covers("orchestrator/store/sql/*.sql", "orchestrator/store/sql/claim.sql")
    assert not covers("orchestrator/core/dag.py", "orchestrator/core/dag/spec.py")
