"""The package's layering, checked from the source: no import circle between its modules
(counting imports inside functions and under ``TYPE_CHECKING`` too, and the package root: an
``from . import default`` inside a function of a submodule is an edge to ``orchestrator``), and
the pure core imports no infrastructure."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
PURE = {
    "dag", "states", "backoff", "poison", "routing", "models", "protocol", "publisher", "registry", "crashpoints",
    "redact", "explain",
}  # fmt: skip
INFRASTRUCTURE = ("celery", "kombu", "redis", "sqlalchemy", "psycopg", "billiard")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, package_dir: Path = PACKAGE) -> set[str]:
    """Every module this file imports, anywhere in it, resolved to absolute names."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import schema` imports the submodule, `from .x import y` the module x
            subs = {f"{target}.{alias.name}" for alias in node.names}
            modules = {m for m in subs if _exists(m, package_dir)}
            found.update(modules or {target})
    return found


def _exists(module: str, package_dir: Path = PACKAGE) -> bool:
    rel = Path(*module.split("."))
    base = package_dir.parent
    return (base / rel).with_suffix(".py").exists() or (base / rel / "__init__.py").exists()


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of the package it imports, the package root and
    subpackages' ``__init__`` included (an import of ``orchestrator.x`` also runs the package's
    ``__init__``, but that implicit step is not counted: only what a module names)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py") if "migrations" not in p.parts}
    return {name: {m for m in imports(path, package) if m in modules and m != name} for name, path in modules.items()}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` (``[a, b, ..., a]``), or ``None``."""
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if seen.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in seen:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        seen[node] = 2
        return None

    for node in sorted(edges):
        if node not in seen:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_inside_the_package() -> None:
    circle = find_circle(graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_package_root_and_imports_inside_functions_count(tmp_path: Path) -> None:
    """The checker sees a circle closed by an import of the package root inside a function
    (the one ``schedules.py`` had: ``__init__`` -> ``celery_app`` -> ``worker`` -> ``engine`` ->
    ``schedules`` -> ``__init__``)."""
    pkg = tmp_path / "orchestrator"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def default():\n    from .app import make\n    return make()\n")
    (pkg / "app.py").write_text("from . import engine\n\ndef make():\n    return engine\n")
    (pkg / "engine.py").write_text("def schedules():\n    from .schedules import S\n    return S\n")
    (pkg / "schedules.py").write_text("class S:\n    pass\n\ndef _default():\n    from . import default\n")
    circle = find_circle(graph(pkg))
    assert circle is not None and "orchestrator" in circle and "orchestrator.schedules" in circle, circle


def test_the_core_is_pure() -> None:
    for name in sorted(PURE):
        found = imports(PACKAGE / f"{name}.py")
        bad = sorted(m for m in found if m.split(".")[0] in INFRASTRUCTURE)
        assert not bad, f"orchestrator.{name} imports {bad}"
