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

from .backoff import Backoff, Jitter
from .config import Settings
from .dag import DAG, Limits, MapArg, MapSpec, Node, OnDeadline, SizeLimits, load_spec
from .engine import Orchestrator, RunHandle
from .errors import (
    ConfigurationError,
    ConflictError,
    CycleError,
    IdempotencyConflict,
    OperatorError,
    OrchestratorError,
    RunNotFound,
    RunTimeout,
    SchemaMissingError,
    Skip,
    SpecError,
    TaskNotFound,
    UnknownLimitError,
    UnknownTaskError,
    ValidationError,
)
from .routing import Priority
from .scheduling import FactoryNotAllowed, dag_factory
from .states import RunState, SkipReason, TaskState, TriggerRule

_default: Orchestrator | None = None


def default() -> Orchestrator:
    """The process-wide :class:`Orchestrator` built from the environment."""
    global _default
    if _default is None:
        from .celery_app import get_app

        _default = Orchestrator(app=get_app())
    return _default


def submit(dag: DAG, **options: Any) -> RunHandle:
    """Submit ``dag`` with the default orchestrator; see :meth:`Orchestrator.submit`."""
    return default().submit(dag, **options)


def get_run(run_id: str) -> RunHandle:
    """A handle on an existing run; raises :class:`RunNotFound`."""
    return default().run(run_id)


__all__ = [
    "DAG",
    "Backoff",
    "ConfigurationError",
    "ConflictError",
    "CycleError",
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
    "RunHandle",
    "RunNotFound",
    "RunState",
    "RunTimeout",
    "SchemaMissingError",
    "Settings",
    "SizeLimits",
    "Skip",
    "SkipReason",
    "SpecError",
    "TaskNotFound",
    "TaskState",
    "TriggerRule",
    "UnknownLimitError",
    "UnknownTaskError",
    "ValidationError",
    "dag_factory",
    "default",
    "get_run",
    "load_spec",
    "submit",
]
