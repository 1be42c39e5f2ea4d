"""Durable DAG workflows on Celery.

>>> from orchestrator import DAG, submit
>>> dag = DAG("revenue", tenant="acme")
>>> a = dag.task("extract", extract_orders.s(day="2026-04-25"))
>>> dag.task("load", load.s(), upstream=[a])
>>> run = submit(dag, idempotency_key="revenue:2026-04-25")
>>> run.wait(timeout=60).state
"""

from __future__ import annotations

from typing import Any

from .core.backoff import Backoff, Jitter
from .core.config import Settings
from .core.dag import DAG, Limits, MapArg, MapSpec, Node, OnDeadline, SizeLimits, load_spec
from .core.errors import (
    BulkFilterError,
    ConfigurationError,
    ConflictError,
    CycleError,
    DagNotFound,
    DagVersionNotFound,
    EmitTimeout,
    EventIdConflict,
    IdempotencyConflict,
    OperatorError,
    OrchestratorError,
    RunNotFound,
    RunTimeout,
    SchemaMissingError,
    Skip,
    SpecError,
    TagError,
    TaskNotFound,
    TransactionalError,
    UnknownLimitError,
    UnknownTaskError,
    ValidationError,
)
from .core.routing import Priority
from .core.states import RunState, SkipReason, TaskState, TriggerRule
from .core.waits import Defer, SensorSpec, WaitSpec
from .engine.facade import Orchestrator, RunHandle
from .services.dag_registry import DagDiff, DagRegistry, DagVersion, RegisteredDag
from .services.targets import FactoryNotAllowed, dag_factory
from .store.waits import Emitted


def default() -> Orchestrator:
    """The process-wide :class:`Orchestrator` built from the environment."""
    from .runtime.celery_app import default_orchestrator

    return default_orchestrator()


def submit(dag: DAG, **options: Any) -> RunHandle:
    """Submit ``dag`` with the default orchestrator; see :meth:`Orchestrator.submit`."""
    return default().submit(dag, **options)


def register(dag: DAG, **options: Any) -> DagVersion:
    """Register ``dag`` with the default orchestrator (a new version when its content changed);
    see :meth:`Orchestrator.register`."""
    return default().register(dag, **options)


def submit_registered(name: str, version: int | None = None, **options: Any) -> RunHandle:
    """A run of the registered DAG ``name`` (its latest version, or ``version``) with the default
    orchestrator; see :meth:`Orchestrator.submit_registered`."""
    return default().submit_registered(name, version, **options)


def emit(key: str, payload: dict[str, Any] | None = None, **options: Any) -> Emitted:
    """Emit the event ``key`` with the default orchestrator; see :meth:`Orchestrator.emit`."""
    return default().events.emit(key, payload, **options)


def get_run(run_id: str) -> RunHandle:
    """A handle on an existing run; raises :class:`RunNotFound`."""
    return default().run(run_id)


__all__ = [
    "DAG",
    "Backoff",
    "BulkFilterError",
    "ConfigurationError",
    "ConflictError",
    "CycleError",
    "DagDiff",
    "DagNotFound",
    "DagRegistry",
    "DagVersion",
    "DagVersionNotFound",
    "Defer",
    "EmitTimeout",
    "Emitted",
    "EventIdConflict",
    "FactoryNotAllowed",
    "IdempotencyConflict",
    "Jitter",
    "Limits",
    "MapArg",
    "MapSpec",
    "Node",
    "OnDeadline",
    "OperatorError",
    "Orchestrator",
    "OrchestratorError",
    "Priority",
    "RegisteredDag",
    "RunHandle",
    "RunNotFound",
    "RunState",
    "RunTimeout",
    "SchemaMissingError",
    "SensorSpec",
    "Settings",
    "SizeLimits",
    "Skip",
    "SkipReason",
    "SpecError",
    "TagError",
    "TaskNotFound",
    "TaskState",
    "TransactionalError",
    "TriggerRule",
    "UnknownLimitError",
    "UnknownTaskError",
    "ValidationError",
    "WaitSpec",
    "dag_factory",
    "default",
    "emit",
    "get_run",
    "load_spec",
    "register",
    "submit",
    "submit_registered",
]
