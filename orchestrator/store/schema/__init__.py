"""The database schema (SQLAlchemy Core), one module per concept, all on one ``metadata``: runs
and tasks (``runs``), workers and their messages (``workers``), what holds tasks back
(``limits``), what starts runs (``starts``), the reconciler's shards (``shards``). A fresh
database is created from it (``migrate.create``); the Alembic migrations must produce exactly it."""

from __future__ import annotations

from .base import TS, metadata
from .limits import breaker_counts, breaker_events, breaker_probes, breakers, dag_limits, pools, rate_limits, tenants
from .runs import (
    DEADLINE_PENDING,
    MAP_CHILD,
    WAITING_DUE,
    WAITING_EVENT,
    edges,
    events,
    idempotency_keys,
    progress,
    runs,
    stripes,
    tasks,
)
from .shards import reconcilers, shard_config, shards
from .starts import dag_versions, dags, emitted, firings, schedules, trigger_firings, triggers
from .workers import deliveries, secrets, worker_tasks, workers

__all__ = [
    "DEADLINE_PENDING", "MAP_CHILD", "TS", "WAITING_DUE", "WAITING_EVENT", "breaker_counts", "breaker_events",
    "breaker_probes", "breakers", "dag_limits", "dag_versions", "dags", "deliveries", "edges", "emitted", "events",
    "firings", "idempotency_keys", "metadata", "pools", "progress", "rate_limits", "reconcilers", "runs", "schedules",
    "secrets", "shard_config", "shards", "stripes", "tasks", "tenants", "trigger_firings", "triggers", "worker_tasks",
    "workers",
]  # fmt: skip
