"""The orchestrator facade: submit DAGs, publish dispatches, tick, and look runs up."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .config import Settings
from .dag import DAG, UPSTREAM_KWARG
from .errors import RunTimeout, ValidationError
from .models import Dispatch, EventView, RunView, TaskView
from .routing import route
from .states import RunState
from .store import Store

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

#: message headers that carry the fencing token of an orchestrated message
HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT = "orc_run", "orc_key", "orc_attempt"


class Orchestrator:
    """Submits DAGs to the database and publishes their tasks to Celery.

    ``settings`` default to the environment; ``app`` to the project's Celery app
    (:func:`orchestrator.celery_app.get_app`); ``store`` to one built from the settings.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        app: Celery | None = None,
        store: Store | None = None,
    ) -> None:
        self.settings = (
            settings or (getattr(app, "orchestrator_settings", None) if app else None) or Settings.from_env()
        )
        self._app = app
        self._store = store

    @cached_property
    def app(self) -> Celery:
        if self._app is None:
            from .celery_app import get_app

            self._app = get_app()
        self._app.loader.import_default_modules()
        return self._app

    @cached_property
    def store(self) -> Store:
        """The store, checked once: the embedded default migrates itself; any other database
        must have been migrated (``orchestrator db upgrade``) or :class:`SchemaMissingError` is raised."""
        store = self._store or Store(self.settings.database_url)
        if store.engine.dialect.name == "sqlite":
            from . import migrate

            migrate.upgrade(store.engine)
        store.check_schema()
        return store

    # ------------------------------------------------------------------ registry

    def is_registered(self, name: str) -> bool:
        """True for tasks of the Celery app that DAG nodes may name (not Celery's or ours)."""
        return name in self.app.tasks and not name.startswith(("celery.", "orchestrator."))

    def wants_upstream(self, name: str) -> bool:
        task = self.app.tasks.get(name)
        return task is not None and declares_upstream(task)

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        dag: DAG,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        logical_date: str | None = None,
    ) -> RunHandle:
        """Validate ``dag``, store it as a run in one transaction and dispatch its roots.

        Idempotent on (DAG name, tenant, ``idempotency_key``): the same key returns the
        handle of the run it created first. Raises :class:`ValidationError` (nothing is
        written or published) for bad input.
        """
        if tenant is not None and tenant != dag.tenant:
            dag = dag.with_tenant(tenant)
        dag.validate(self.is_registered, self.settings.limits)
        self._check_time_limits(dag)
        if idempotency_key is not None and (
            not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= 200
        ):
            raise ValidationError("idempotency key must be a string of 1 to 200 characters", dag=dag.name)
        queues = {
            n.key: route(dag.tenant, dag.priority_of(n), n.queue, self.settings.dedicated_tenants)
            for n in dag.nodes.values()
        }
        run_id, created = self.store.create_run(
            dag,
            queues=queues,
            wants_upstream=self.wants_upstream,
            idempotency_key=idempotency_key,
            logical_date=logical_date,
        )
        if created:
            self.publish(self.store.admit_ready(self.settings.dispatch_window))
        return RunHandle(self, run_id)

    def _check_time_limits(self, dag: DAG) -> None:

        for node in dag.nodes.values():
            if node.time_limit is not None and node.time_limit > self.settings.max_time_limit:
                raise ValidationError(
                    f"time_limit {node.time_limit}s exceeds ORCHESTRATOR_MAX_TIME_LIMIT"
                    f" ({self.settings.max_time_limit}s)",
                    dag=dag.name,
                    node=node.key,
                )

    # ------------------------------------------------------------------ dispatch

    def publish(self, dispatches: Iterable[Dispatch]) -> int:
        """Publish one Celery message per dispatch; returns how many were sent.

        Called only after the QUEUED rows are committed. A publish that fails leaves its
        row QUEUED for the reconciler to re-publish; it is logged, not raised.
        """
        batch = list(dispatches)
        if not batch:
            return 0
        sent = 0
        try:
            with self.app.producer_or_acquire() as producer:
                for d in batch:
                    self.app.send_task(
                        d.task_name,
                        args=d.args,
                        kwargs=d.kwargs,
                        queue=d.queue,
                        task_id=d.task_id,
                        headers={HEADER_RUN: d.run_id, HEADER_KEY: d.key, HEADER_ATTEMPT: d.attempt},
                        soft_time_limit=d.soft_time_limit,
                        time_limit=d.time_limit,
                        producer=producer,
                    )
                    sent += 1
        except Exception:
            log.exception(
                "publish failed after %d of %d messages; the reconciler re-publishes the rest", sent, len(batch)
            )
        return sent

    def tick(self) -> int:
        """One beat tick: due retries become READY and free capacity is dispatched.

        Returns the number of messages published.
        """
        _released, dispatches = self.store.release_due_retries(self.settings.dispatch_window)
        return self.publish(dispatches)

    # ------------------------------------------------------------------ reads

    def run(self, run_id: str) -> RunHandle:
        self.store.get_run(run_id)
        return RunHandle(self, run_id)

    def runs(self, limit: int = 20, tenant: str | None = None) -> list[RunView]:
        return self.store.list_runs(limit, tenant=tenant)


class RunHandle:
    """A submitted run: ``id``, ``status()``, ``tasks()``, ``wait()``, ``results()``."""

    def __init__(self, orchestrator: Orchestrator, run_id: str) -> None:
        self.orchestrator = orchestrator
        self.id = run_id

    def __repr__(self) -> str:
        return f"<RunHandle {self.id}>"

    def status(self) -> RunView:
        return self.orchestrator.store.get_run(self.id)

    @property
    def state(self) -> RunState:
        return self.orchestrator.store.run_state(self.id)

    def tasks(self) -> list[TaskView]:
        return self.orchestrator.store.get_tasks(self.id)

    def task(self, key: str) -> TaskView:
        return self.orchestrator.store.get_task(self.id, key)

    def events(self) -> list[EventView]:
        return self.orchestrator.store.events(self.id)

    def results(self) -> dict[str, Any]:
        """The stored JSON result of every task that succeeded, by node key."""
        return {t.key: t.result for t in self.tasks() if t.state.value == "SUCCEEDED"}

    def wait(self, timeout: float | None = None, *, poll: float = 0.1) -> RunView:
        """Block until the run is final; raise :class:`RunTimeout` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.state.terminal:
                return self.status()
            if deadline is not None and time.monotonic() >= deadline:
                raise RunTimeout(f"run {self.id} still running after {timeout}s")
            time.sleep(poll)


def declares_upstream(task: Any) -> bool:
    """Whether a task's function declares a parameter named ``upstream``."""
    try:
        params = inspect.signature(task.run).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(UPSTREAM_KWARG)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
