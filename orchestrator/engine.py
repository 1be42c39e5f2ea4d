"""The orchestrator facade: submit DAGs, publish dispatches, tick, and look runs up."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .alerts import raise_alert
from .config import Settings
from .crashpoints import crash_point
from .dag import DAG, UPSTREAM_KWARG
from .errors import RunTimeout, ValidationError
from .models import Dispatch, EventView, RunView, TaskView
from .routing import route
from .states import RunState, TaskState
from .store import Outcome, Store

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)
_Item = Any

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
        s = self.settings
        store = self._store or Store(
            s.database_url,
            poison_threshold=s.poison_threshold,
            crash_loop_threshold=s.crash_loop_threshold,
            worker_ttl=s.worker_ttl,
        )
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
        wants = {name: self.wants_upstream(name) for name in {n.task for n in dag.nodes.values()}}
        run_id, created = self.store.create_run(
            dag,
            queues=queues,
            wants_upstream=wants.__getitem__,
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
        crash_point("after_dispatch_commit")
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

    def settle(self, outcome: Outcome, run_id: str, key: str) -> None:
        """After a committed outcome: publish what it admitted, alert if it parked the task."""
        self.publish(outcome.dispatches)
        if outcome.accepted and outcome.state is TaskState.DEAD_LETTER:
            task = self.store.get_task(run_id, key)
            alert = {
                "run_id": run_id,
                "key": key,
                "task": task.task,
                "attempt": task.attempt,
                "error": task.error,
                "fingerprint": task.fingerprint,
            }
            raise_alert(alert, webhook=self.settings.alert_webhook or None, actor="orchestrator")

    def reconcile(self) -> dict[str, int]:
        """One reconcile pass (beat runs it every ``tick_seconds``); returns counts per action.

        Due retries -> READY; QUEUED unclaimed past the dispatch timeout -> re-published with
        the same attempt; RUNNING past its lease -> attempt failed (RETRYING / FAILED /
        DEAD_LETTER); READY with free capacity -> dispatched; runs with every task terminal ->
        final state. Each item is handled on its own: an error is logged and counted, and the
        pass goes on. Concurrent passes act once per item (CAS, ``SKIP LOCKED``).
        """
        s = self.settings
        report = dict.fromkeys(
            ("released", "republished", "leases_expired", "dispatched", "runs_finalized", "errors"), 0
        )
        try:
            released, dispatches = self.store.release_due_retries(s.dispatch_window)
            report["released"] = released
            report["dispatched"] += self.publish(dispatches)
        except Exception:
            log.exception("reconcile: releasing due retries failed")
            report["errors"] += 1
        for run_id, key, attempt, dispatched_at in self._safely(report, self.store.stale_queued, s.dispatch_timeout):
            try:
                d = self.store.redispatch(run_id, key, attempt, dispatched_at)
                if d is not None:
                    report["republished"] += self.publish([d])
            except Exception:
                log.exception("reconcile: re-publishing %s.%s failed", run_id, key)
                report["errors"] += 1
        for run_id, key, attempt in self._safely(report, self.store.expired_leases, s.lease_seconds):
            try:
                outcome = self.store.lose_lease(run_id, key, attempt, s.lease_seconds, s.dispatch_window)
                report["leases_expired"] += int(outcome.accepted)
                self.settle(outcome, run_id, key)
            except Exception:
                log.exception("reconcile: expiring the lease of %s.%s failed", run_id, key)
                report["errors"] += 1
        try:
            report["dispatched"] += self.publish(self.store.admit_ready(s.dispatch_window))
            report["runs_finalized"] = self.store.finalize_runs()
        except Exception:
            log.exception("reconcile: dispatch or run finalization failed")
            report["errors"] += 1
        return report

    def tick(self) -> dict[str, int]:
        """Beat's periodic tick: one reconcile pass."""
        return self.reconcile()

    @staticmethod
    def _safely(report: dict[str, int], fn: Callable[[float], list[_Item]], arg: float) -> list[_Item]:
        try:
            return fn(arg)
        except Exception:
            log.exception("reconcile: %s failed", fn.__name__)
            report["errors"] += 1
            return []

    # ------------------------------------------------------------------ operator actions

    def retry_task(self, run_id: str, key: str) -> None:
        """DEAD_LETTER or FAILED -> READY with ``attempt + 1``; raises :class:`OperatorError`."""
        self.settle(self.store.retry_task(run_id, key, self.settings.dispatch_window), run_id, key)

    def skip_task(self, run_id: str, key: str) -> None:
        """DEAD_LETTER -> SKIPPED; descendants follow their trigger rules."""
        self.settle(
            self.store.resolve_dead_letter(run_id, key, TaskState.SKIPPED, self.settings.dispatch_window), run_id, key
        )

    def fail_task(self, run_id: str, key: str) -> None:
        """DEAD_LETTER -> FAILED (give up); descendants follow their trigger rules."""
        self.settle(
            self.store.resolve_dead_letter(run_id, key, TaskState.FAILED, self.settings.dispatch_window), run_id, key
        )

    def cancel(self, run_id: str) -> int:
        """Cancel a run: its open tasks become CANCELLED and the attempts in flight are revoked
        with terminate (their late results are then rejected). Returns how many were revoked."""
        in_flight = self.store.cancel_run(run_id)
        if in_flight:
            try:
                self.app.control.revoke(in_flight, terminate=True, signal="SIGTERM")
            except Exception:
                log.exception(
                    "revoking %d task(s) of run %s failed; their results will be rejected", len(in_flight), run_id
                )
        return len(in_flight)

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

    def cancel(self) -> int:
        return self.orchestrator.cancel(self.id)

    def retry(self, key: str) -> None:
        self.orchestrator.retry_task(self.id, key)

    def skip(self, key: str) -> None:
        self.orchestrator.skip_task(self.id, key)

    def fail(self, key: str) -> None:
        self.orchestrator.fail_task(self.id, key)

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
