"""A driver for dynamic-DAG store tests: it plays the workers' part (claim, then succeed, fail
or skip through the same store calls a worker makes) without Celery, so a test states what
each task does and reads what the database decided."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from orchestrator import DAG, Defer, Orchestrator, Settings, Skip
from orchestrator.core.models import Claim
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.store import Store
from orchestrator.store.schema import tasks as t

TASKS = ["t", "up"]


class Fail(Exception):
    """What a body raises to fail its attempt (in :func:`drive`'s ``body``)."""


@dataclass
class Driven:
    orc: Orchestrator
    store: Store
    run_id: str
    #: (key, kwargs, upstream) of every attempt run, in order
    ran: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    #: what each attempt that was called again after it deferred got (key -> resumed, newest)
    resumed: dict[str, Any] = field(default_factory=dict)

    def states(self) -> dict[str, str]:
        return {t.key: t.state.value for t in self.orc.tasks(self.run_id)}

    def run_state(self) -> str:
        return self.orc.run_state(self.run_id).value


def orchestrator(pg_url: str, **settings: Any) -> Orchestrator:
    store = Store(pg_url)
    store.workers.register("w", default_queues(), 1000)
    return Orchestrator(
        Settings(database_url=pg_url, **settings),
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(TASKS, upstream=["up"]),
    )


def drive(
    orc: Orchestrator,
    dag: DAG,
    body: Callable[[str, dict[str, Any], dict[str, Any]], Any] = lambda key, kw, up: None,
    *,
    steps: int = 100_000,
    until: Callable[[Driven], bool] | None = None,
    run_id: str | None = None,
) -> Driven:
    """Submit ``dag`` (or take ``run_id``) and run its tasks one at a time in admission order:
    ``body(key, kwargs, upstream)`` returns the result, or raises :class:`Fail`,
    :class:`orchestrator.Skip` or :class:`orchestrator.Defer` (a sensor's falsy result waits for
    its next check, as the worker does). Stops when nothing is QUEUED, after ``steps`` attempts, or
    once ``until`` says so."""
    store = orc.store
    if run_id is None:
        run_id = orc.submit(dag).id
    driven = Driven(orc, store, run_id)
    for _ in range(steps):
        if until is not None and until(driven):
            break
        store.admission.admit_ready(10_000)
        with store.engine.connect() as conn:
            task = conn.execute(
                sa.select(t.c.key, t.c.attempt, t.c.task_name)
                .where(t.c.run_id == run_id, t.c.state == "QUEUED")
                .order_by(t.c.ready_at, t.c.key)
                .limit(1)
            ).first()
        if task is None:
            break
        claim = store.attempts.claim(run_id, task.key, task.attempt, "w:1", 60.0, task.task_name)
        assert isinstance(claim, Claim), task.key
        driven.ran.append((task.key, claim.kwargs, claim.upstream_results))
        if claim.resumed is not None:
            driven.resumed[task.key] = claim.resumed
        try:
            result = body(task.key, claim.kwargs, claim.upstream_results)
        except Defer as exc:
            store.waits.defer(run_id, task.key, task.attempt, json.dumps(exc.spec()), 10_000)
        except Skip as exc:
            store.attempts.skip(run_id, task.key, task.attempt, exc.reason, 10_000)
        except Fail as exc:
            store.attempts.fail(run_id, task.key, task.attempt, error=str(exc), window=10_000, retryable=False)
        else:
            if claim.sensor is not None and not result:
                from orchestrator.runtime.worker import sensor_defer

                spec = sensor_defer(claim.sensor, claim.resumed)
                store.waits.defer(run_id, task.key, task.attempt, json.dumps(spec), 10_000)
                continue
            store.attempts.succeed(run_id, task.key, task.attempt, result, 10_000)
    return driven
