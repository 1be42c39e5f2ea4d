"""Every import path the README and the docs show keeps working after the move into folders: the
public modules at the package root hand on the names of the floors below, the console script and
``python -m orchestrator.cli`` reach the CLI, and ``celery -A config.celery_app`` finds the app."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PUBLIC = {
    "orchestrator": [
        "DAG", "submit", "register", "submit_registered", "emit", "get_run", "default", "Orchestrator", "RunHandle",
        "Settings", "Backoff", "Jitter", "Priority", "RunState", "TaskState", "TriggerRule", "Defer", "WaitSpec",
        "SensorSpec", "MapArg", "MapSpec", "Limits", "load_spec", "dag_factory", "DagRegistry", "OrchestratorError",
        "ValidationError", "Skip",
    ],
    "orchestrator.dag": ["DAG", "Node", "MapArg", "MapSpec", "Limits", "SizeLimits", "OnDeadline", "load_spec"],
    "orchestrator.celery_app": ["get_app", "create_app"],
    "orchestrator.worker": ["current_context", "TaskContext", "OrchestratedTask", "OrchestratedRequest", "LeaseLost"],
    "orchestrator.beat": ["DatabaseScheduler"],
    "orchestrator.alerts": ["task_dead_lettered", "task_stuck", "deadline_missed", "breaker_changed"],
    "orchestrator.schedules": ["add", "pause", "resume", "remove"],
    "orchestrator.testing": ["run_dag"],
    "orchestrator.testing.plugin": [],
    "orchestrator.engine": ["Orchestrator", "RunHandle"],
    "orchestrator.cli": ["main"],
    "config.celery_app": ["app"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_a_documented_module_imports_with_its_names(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_the_public_modules_hand_on_the_same_objects_as_their_floors() -> None:
    from orchestrator import celery_app, dag, worker
    from orchestrator.core import dag as core_dag
    from orchestrator.runtime import celery_app as runtime_app
    from orchestrator.runtime import worker as runtime_worker

    assert dag.DAG is core_dag.DAG
    assert celery_app.get_app is runtime_app.get_app
    assert worker.current_context is runtime_worker.current_context
    assert worker.OrchestratedTask is runtime_worker.OrchestratedTask


def test_the_celery_class_paths_of_the_docs_resolve() -> None:
    """``task_cls="orchestrator.worker:OrchestratedTask"`` in a user's Celery config (the docs show it)."""
    from celery.utils.imports import symbol_by_name

    from orchestrator.runtime.worker import OrchestratedRequest, OrchestratedTask

    assert symbol_by_name("orchestrator.worker:OrchestratedTask") is OrchestratedTask
    assert symbol_by_name("orchestrator.worker:OrchestratedRequest") is OrchestratedRequest
    beat = symbol_by_name("orchestrator.beat:DatabaseScheduler")
    assert beat is symbol_by_name("orchestrator.runtime.beat:DatabaseScheduler")


def test_the_console_script_and_python_m_reach_the_cli() -> None:
    from orchestrator.cli import main

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "orchestrator"]
    assert script.value == "orchestrator.cli:main"
    assert script.load() is main
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "Usage:" in out.stdout and "submit" in out.stdout


def test_the_pytest_plugin_entry_point_is_the_kit() -> None:
    (plugin,) = [ep for ep in entry_points(group="pytest11") if ep.name == "orchestrator"]
    assert plugin.value == "orchestrator.testing.plugin"
    importlib.import_module(plugin.value)


def test_paths_computed_from_a_module_file_still_name_what_they_named_before_the_move() -> None:
    """A frame in any floor of the package is the orchestrator's own, never task code (the
    fingerprint of a failure skips it), and the chaos soak starts its processes at the repository."""
    import orchestrator
    from orchestrator.core import poison
    from orchestrator.testing.chaos import ROOT

    package = Path(orchestrator.__file__).resolve().parent
    assert Path(poison._OWN_PACKAGE) == package
    for floor in ("runtime/worker.py", "engine/facade.py", "store/hotpath.py"):
        assert not poison._is_task_code(str(package / floor)), floor
    assert poison._is_task_code(str(package.parent / "tasks" / "probes.py"))
    assert (ROOT / "tasks" / "probes.py").exists() and (ROOT / "pyproject.toml").exists()
