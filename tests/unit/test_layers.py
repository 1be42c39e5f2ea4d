"""The package's layering, checked from the source: no import circle between its modules
(counting imports inside functions too), and the pure core imports no infrastructure."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
PURE = {
    "dag", "states", "backoff", "poison", "routing", "models", "protocol", "publisher", "registry", "crashpoints",
    "redact", "explain",
}  # fmt: skip
INFRASTRUCTURE = ("celery", "kombu", "redis", "sqlalchemy", "psycopg", "billiard")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it, resolved to absolute names."""
    name = module_name(path)
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
            modules = {m for m in subs if _exists(m)}
            found.update(modules or {target})
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    base = PACKAGE.parent
    return (base / rel).with_suffix(".py").exists() or (base / rel / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_circle_inside_the_package() -> None:
    edges = graph()
    # the package __init__ re-exports the API: it may import anything, nothing imports it back
    edges.pop("orchestrator", None)
    for deps in edges.values():
        deps.discard("orchestrator")
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if seen.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if dep not in seen:
                visit(dep)
        stack.pop()
        seen[node] = 2

    for node in sorted(edges):
        if node not in seen:
            visit(node)


def test_the_core_is_pure() -> None:
    for name in sorted(PURE):
        found = imports(PACKAGE / f"{name}.py")
        bad = sorted(m for m in found if m.split(".")[0] in INFRASTRUCTURE)
        assert not bad, f"orchestrator.{name} imports {bad}"
