"""The orchestrator facade: submit DAGs, the worker's calls, operator actions, reads.

:class:`Orchestrator` is the one object applications, workers, the reconciler and the CLI
talk to. It owns no Celery code: messages leave through a :class:`~orchestrator.core.publisher.Publisher`
and task names are checked against a :class:`~orchestrator.core.registry.TaskRegistry`, both given
by the caller (``app=`` wires the Celery ones; unit tests pass in-memory ones).

It is the wall around the store: no other module of the package reaches ``Orchestrator.store``.
Bound to a tenant, it reads and acts through the store's roles scoped to that tenant
(``Reads.scoped``, ``OperatorActions.scoped``, ``ScheduleRows.scoped``), so a run or a schedule
of another tenant is not found wherever it is asked for, by whichever caller.
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import time
import uuid
from collections.abc import Collection, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..core.config import Settings
from ..core.crashpoints import crash_point
from ..core.dag import (
    DAG,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_LOGICAL_DATE_CHARS,
    TENANT_RE,
    check_json,
    dag_from_spec,
    text_problem,
)
from ..core.errors import ConfigurationError, ConflictError, OperatorError, RunTimeout, TaskNotFound, ValidationError
from ..core.explain import Explanation, explain
from ..core.models import (
    WORKER,
    Actor,
    Claim,
    EventView,
    MetricsSnapshot,
    Outcome,
    Pool,
    RateLimit,
    RunView,
    TaskView,
    operator,
)
from ..core.protocol import FencingToken
from ..core.publisher import CeleryPublisher, Publisher
from ..core.registry import CeleryRegistry, TaskRegistry
from ..core.routing import queue_tenant, route
from ..core.states import RunState, TaskState
from ..core.waits import check_event_key
from ..services.alerts import raise_alert
from ..services.reconciler import Reconciler
from ..store import Store
from ..store.breakers import Breaker, BreakerEvent
from ..store.operator import OperatorActions
from ..store.reads import Reads
from ..store.waits import Emitted

if TYPE_CHECKING:
    from ..services.dag_registry import DagRegistry, DagVersion
    from ..services.scheduling import Schedules
    from ..services.triggers import Triggers

log = logging.getLogger(__name__)
#: the longest event id (``emit(..., event_id=...)``)
MAX_EVENT_ID_CHARS = 200


def _iso_problem(value: str) -> str | None:
    """``None`` when ``value`` is an ISO-8601 date or date-time."""
    import datetime as dt

    try:
        dt.datetime.fromisoformat(value)
    except ValueError:
        return f"{value!r} is not an ISO-8601 date or date-time"
    return None


def os_user() -> str:
    """Who runs this process (the ``by`` of operator actions that do not name anyone)."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database entry (containers): still act, unnamed
        return "unknown"


def local_by(via: str | None = None) -> str:
    """Who acts from this process, and from where: ``user@host``, with ``(via)`` when given
    (the CLI records ``alice@ops-1 (cli)``); the default ``by`` of operator actions."""
    import socket

    where = f"{os_user()}@{socket.gethostname()}"
    return f"{where} ({via})" if via else where


class Orchestrator:
    """Submits DAGs to the database and publishes their tasks.

    ``settings`` default to ``app.orchestrator_settings`` or the environment; ``store`` to
    one built from the settings. Give either ``app`` (a Celery app: publishes with it and
    checks task names against its registry) or both ``publisher`` and ``registry``.
    Raises :class:`ConfigurationError` with neither.

    ``tenant`` (default ``ORCHESTRATOR_TENANT``) binds the orchestrator to one tenant: it submits
    as that tenant, and a run of another tenant is :class:`RunNotFound` to it, for reads and
    operator actions alike (the store's roles it works through are scoped to the tenant, so no
    caller has to remember a check). Unbound, it acts for every tenant (the deployment's
    operator). Metrics of a bound orchestrator are its tenant's; the deployment's (workers,
    reconciler duty) are the operator's only.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        app: Any = None,
        store: Store | None = None,
        publisher: Publisher | None = None,
        registry: TaskRegistry | None = None,
        tenant: str | None = None,
    ) -> None:
        self.settings = settings or getattr(app, "orchestrator_settings", None) or Settings.from_env()
        self.app = app
        #: the tenant this orchestrator acts as (``tenant=`` or ``ORCHESTRATOR_TENANT``); ``None``:
        #: every tenant. A bound orchestrator sees, acts on and submits its tenant's runs only.
        self.tenant: str | None = tenant if tenant is not None else (self.settings.tenant or None)
        if self.tenant is not None and not TENANT_RE.fullmatch(self.tenant):
            raise ConfigurationError(f"tenant {self.tenant!r} must be 1-64 letters, digits, '_' or '-'")
        if app is None and (publisher is None or registry is None):
            raise ConfigurationError(
                "Orchestrator needs a Celery app (app=...) or both a publisher and a task registry;"
                " orchestrator.default() builds one from the environment"
            )
        self.publisher: Publisher = publisher or CeleryPublisher(app, lambda: self.store.signing_key)
        self.registry: TaskRegistry = registry or CeleryRegistry(app)
        self._store = store

    @cached_property
    def store(self) -> Store:
        """The store, checked once: the embedded default migrates itself (one process at a time);
        any other database must have been migrated (``orchestrator db upgrade``) or
        :class:`SchemaMissingError` is raised."""
        s = self.settings
        store = self._store or Store(
            s.database_url,
            poison_threshold=s.poison_threshold,
            crash_loop_threshold=s.crash_loop_threshold,
            worker_ttl=s.worker_ttl,
            dispatch_depth=s.dispatch_depth,
            # an outage delays an outcome, it never decides it: keep trying while a lease may hold
            retry_seconds=s.lease_seconds,
            priority_aging=s.priority_aging_seconds,
            pool_size=s.db_pool_size,
            group_commit=s.group_commit,
            transaction_pooler=s.db_transaction_pooler,
            direct_url=s.db_direct_url,
        )
        if s.embedded and self._store is None:
            from ..store import migrate

            migrate.upgrade(store.engine)
        store.check_schema()
        return store

    def ready(self) -> Orchestrator:
        """Open the store now (migrating the embedded default, checking any other schema)
        rather than on first use; returns ``self``."""
        self.store  # noqa: B018 - the check is in the property
        return self

    @cached_property
    def reads(self) -> Reads:
        """The read port: the store's reads as this orchestrator may see them (its tenant's runs
        only, when bound). Besides the facade's own reads, it has the diagnostics the chaos
        soak and the tests use (``snapshot``, ``in_flight``, ``task_states``, ...)."""
        return self.store.reads.scoped(self.tenant)

    @cached_property
    def _operator(self) -> OperatorActions:
        """The store's operator actions as this orchestrator may take them (its tenant's runs)."""
        return self.store.operator.scoped(self.tenant)

    @property
    def signing_key(self) -> bytes:
        """The deployment's key for the fencing headers' signature."""
        return self.store.signing_key

    @property
    def database_url(self) -> str:
        """The database this orchestrator uses, password included (redact it before showing)."""
        return str(self.store.engine.url.render_as_string(hide_password=False))

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the database is out for a while (a lost or refused connection),
        rather than that the call was wrong."""
        return bool(self.store.db.transient(exc))

    def after_fork(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them."""
        if "store" in self.__dict__:
            self.store.engine.dispose(close=False)

    @cached_property
    def reconciler(self) -> Reconciler:
        return Reconciler(
            self.store, self.publisher, self.settings, after=self._after,
            triggers=lambda: sum(1 for f in self.triggers.tick() if f.state == "fired"),
        )  # fmt: skip

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        dag: DAG,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        logical_date: str | None = None,
        schedule: str | None = None,
        dag_version: int | None = None,
        trigger: str | None = None,
    ) -> RunHandle:
        """Validate ``dag``, store it as a run in one transaction, then admit and publish
        what live workers can take (a second transaction, after the run is committed).

        Idempotent on (DAG name, tenant, ``idempotency_key``): the same key returns the
        handle of the run it created first; and on (``schedule``, ``logical_date``): the
        scheduler's firings and backfills create one run per instant however often they try.
        ``schedule`` (the scheduler's, :mod:`orchestrator.schedules`) must name an existing
        schedule of the run's tenant, with a ``logical_date``. ``dag_version`` is the registered
        version the DAG was built from (:meth:`submit_registered`, a schedule on a registered DAG;
        recorded on the run). ``trigger`` names the event trigger that started the run
        (:mod:`orchestrator.services.triggers`; recorded on the run). A run by hand of a DAG that is
        registered and paused still runs; its handle's ``warnings`` say so. Raises
        :class:`ValidationError` (nothing is written or published) for bad input.
        """
        dag = self.check(dag, tenant=tenant)
        if idempotency_key is not None:
            problem = text_problem(idempotency_key, MAX_IDEMPOTENCY_KEY_CHARS)
            if problem:
                raise ValidationError(f"idempotency key {problem}", dag=dag.name)
        if logical_date is not None:
            problem = text_problem(logical_date, MAX_LOGICAL_DATE_CHARS) or _iso_problem(logical_date)
            if problem:
                raise ValidationError(f"logical_date {problem}", dag=dag.name)
        if schedule is not None:
            # a schedule's run: its tenant's schedule only (names are per tenant; another
            # tenant's schedule of that name is another schedule, with runs of its own)
            rows = self.store.schedule_rows.scoped(dag.tenant)
            found = rows.get(schedule) if isinstance(schedule, str) else None
            if found is None:
                raise ValidationError(f"no schedule named {schedule!r} for tenant {dag.tenant!r}", dag=dag.name)
            if logical_date is None:
                raise ValidationError(f"a run of schedule {schedule!r} needs its logical_date", dag=dag.name)
        dedicated = set(self.settings.dedicated_tenants)
        if dag.tenant not in dedicated and dag.tenant in self.store.tenants.dedicated():
            dedicated.add(dag.tenant)
        queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue, dedicated) for n in dag.nodes.values()}
        wants = {name: self.registry.wants_upstream(name) for name in {n.task for n in dag.nodes.values()}}
        run_id, created = self.store.submission.create_run(
            dag,
            queues=queues,
            wants_upstream=wants.__getitem__,
            idempotency_key=idempotency_key,
            logical_date=logical_date,
            schedule=schedule,
            dag_version=dag_version,
            trigger=trigger,
        )
        if created:
            self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        warnings = dag.lint()
        if schedule is None and self.store.dags.is_paused(dag.tenant, dag.name):
            warnings.append(
                f"DAG {dag.name!r} is paused: schedules and events start no run of it; this submit by hand does"
                f" (orchestrator dag unpause {dag.name})"
            )
        return RunHandle(self, run_id, warnings=warnings)

    # ------------------------------------------------------------------ events, signals, approvals

    def _payload(self, payload: Any, what: str) -> str:
        """``payload`` as JSON text, checked: plain JSON, an object (or None: ``{}``), at most
        ORCHESTRATOR_MAX_EVENT_BYTES."""
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise ValidationError(f"{what} payload must be a JSON object, not {type(payload).__name__}")
        check_json(payload, f"{what} payload")
        body = json.dumps(payload)
        if len(body.encode()) > self.settings.max_event_bytes:
            raise ValidationError(
                f"{what} payload exceeds {self.settings.max_event_bytes} bytes of JSON (ORCHESTRATOR_MAX_EVENT_BYTES)"
            )
        return body

    @staticmethod
    def _event_id(event_id: Any) -> str:
        if event_id is None:
            return uuid.uuid4().hex
        problem = text_problem(event_id, MAX_EVENT_ID_CHARS) if isinstance(event_id, str) else "must be a string"
        if problem:
            raise ValidationError(f"event_id {problem}")
        return str(event_id)

    def emit(
        self,
        key: str,
        payload: dict[str, Any] | None = None,
        *,
        event_id: str | None = None,
        tenant: str | None = None,
        by: str | None = None,
    ) -> Emitted:
        """Emit the event ``key`` with a JSON object ``payload`` for ``tenant`` (a bound
        orchestrator: its own; else ``tenant`` or ``default``): written once per ``event_id``
        (a second emit of the same id, key and payload is ignored: ``duplicate``), and every task
        of the tenant WAITING for that key whose match the payload contains is woken in the
        same transaction; what they made READY is published after it. Raises
        :class:`ValidationError` (nothing written) for a bad key, payload or event id,
        :class:`EventIdConflict` for an ``event_id`` the tenant used with another key or payload,
        :class:`EmitTimeout` past ``ORCHESTRATOR_EMIT_TIMEOUT_SECONDS``."""
        check_event_key(key)
        owner = self._tenant_of(tenant)
        body = self._payload(payload, "event")
        done = self.store.waits.emit(
            owner, key, body, self._event_id(event_id), None, by, self.settings.dispatch_window,
            self.settings.emit_timeout_seconds,
        )  # fmt: skip
        self.publisher.publish(done.dispatches)
        if not done.duplicate:  # the event triggers' runs (any beat finishes what this leaves)
            self.triggers.finish(done.id)
        return done

    def signal(
        self, run_id: str, name: str, payload: dict[str, Any] | None = None, *, event_id: str | None = None,
        by: str | None = None,
    ) -> Emitted:  # fmt: skip
        """Send the signal ``name`` to one run: its tasks WAITING for ``name`` (a wait node's
        ``event=``, a ``Defer(event=...)``) whose match the payload contains are woken; a task of
        the run that begins to wait for it later finds it (the lookback). Raises
        :class:`RunNotFound` (another tenant's run too) or :class:`ValidationError`."""
        check_event_key(name, what="signal")
        body = self._payload(payload, "signal")
        view = self.visible(run_id)
        done = self.store.waits.emit(
            view.tenant, name, body, self._event_id(event_id), run_id, by, self.settings.dispatch_window,
            self.settings.emit_timeout_seconds,
        )  # fmt: skip
        self.publisher.publish(done.dispatches)
        return done

    def approve(self, run_id: str, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Answer an approval node (``dag.approval``) yes: it SUCCEEDS with ``{"approved": true,
        "by", "comment"}``, recorded with who answered. Raises :class:`RunNotFound`,
        :class:`TaskNotFound` or :class:`OperatorError` (the task is not waiting for an
        approval); nothing is written then."""
        self._answer(run_id, key, True, by, comment)

    def reject(self, run_id: str, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Answer an approval node no: it FAILS (``Rejected: ...``), its downstream follows its
        trigger rules. Raises as :meth:`approve`."""
        self._answer(run_id, key, False, by, comment)

    def _answer(self, run_id: str, key: str, yes: bool, by: str | None, comment: str | None) -> None:
        who = by or local_by()
        if comment is not None and (not isinstance(comment, str) or len(comment) > 2000):
            raise ValidationError("an approval's comment is text of at most 2000 characters")
        payload = {"approved": yes, "by": who, "comment": comment}
        what = "approved" if yes else "rejected"
        reason = f"{what} by {who}" + (f": {comment}" if comment else "")
        dispatches = self.store.waits.answer(
            run_id, key, "approve" if yes else "reject", json.dumps(payload), operator(who).by or who, reason,
            self.settings.dispatch_window, self.tenant,
        )  # fmt: skip
        self.publisher.publish(dispatches)

    def _tenant_of(self, tenant: str | None) -> str:
        """The tenant an emit acts for: a bound orchestrator's own (another is refused), else
        ``tenant`` or ``default``."""
        if self.tenant is not None:
            if tenant is not None and tenant not in (self.tenant, "default"):
                raise ValidationError(
                    f"this orchestrator acts as tenant {self.tenant!r}; it cannot emit for {tenant!r}"
                )
            return self.tenant
        owner = tenant or "default"
        if not isinstance(owner, str) or not TENANT_RE.fullmatch(owner):
            raise ValidationError(f"tenant {owner!r} must be 1-64 letters, digits, '_' or '-'")
        return owner

    @cached_property
    def dags(self) -> DagRegistry:
        """The DAG registry (:mod:`orchestrator.services.dag_registry`): register, versions, diff,
        pause, and runs by name."""
        from ..services.dag_registry import DagRegistry

        return DagRegistry(self)

    def register(self, dag: DAG, *, by: str | None = None) -> DagVersion:
        """Store ``dag`` in the registry under its name for its tenant: a new version when its
        content differs from the latest, else the latest (``created`` false). Validated as a
        submit is; nothing stored when it would not submit. See :class:`DagRegistry`."""
        return self.dags.register(dag, by=by or local_by())

    def submit_registered(
        self,
        name: str,
        version: int | None = None,
        *,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        tenant: str | None = None,
    ) -> RunHandle:
        """A run of the registered DAG ``name`` at ``version`` (None: its latest), ``params``
        laid over the DAG's own; the run records the version it was made from. Raises
        :class:`DagNotFound` / :class:`DagVersionNotFound`, or what :meth:`submit` raises."""
        handle: RunHandle = self.dags.submit(
            name, version, params=params, idempotency_key=idempotency_key, tenant=tenant
        )
        return handle

    def check(self, dag: DAG, *, tenant: str | None = None) -> DAG:
        """Everything :meth:`submit` checks before it writes: the DAG itself, its task names,
        its queues, time limits, pools and rate limits, and the caller's tenant. Returns the DAG
        as it would be submitted (for ``tenant``, when given); raises :class:`ValidationError`."""
        if self.tenant is not None:
            for asked in (tenant, dag.tenant):
                if asked is not None and asked not in (self.tenant, "default"):
                    raise ValidationError(
                        f"this orchestrator acts as tenant {self.tenant!r}; it cannot submit for tenant {asked!r}",
                        dag=dag.name if isinstance(dag.name, str) else None,
                    )
            tenant = self.tenant
        if tenant is not None and tenant != dag.tenant:
            dag = dag.with_tenant(tenant)
        dag.validate(self.registry.is_registered, self.settings.limits)
        for node in dag.nodes.values():
            owner = queue_tenant(node.queue) if node.queue else None
            if owner is not None and owner != dag.tenant:
                raise ValidationError(
                    f"queue {node.queue!r} is tenant {owner!r}'s dedicated queue; a run of tenant"
                    f" {dag.tenant!r} cannot use it",
                    dag=dag.name,
                    node=node.key,
                )
        self._check_time_limits(dag)
        self.store.limits.check_dag(dag)
        return dag

    def _check_time_limits(self, dag: DAG) -> None:
        """Every hard limit at most ORCHESTRATOR_MAX_TIME_LIMIT; a soft limit below the hard
        limit that will apply (the node's own, or that setting)."""
        most = self.settings.max_time_limit
        for node in dag.nodes.values():
            if node.time_limit is not None and node.time_limit > most:
                raise ValidationError(
                    f"time_limit {node.time_limit}s exceeds ORCHESTRATOR_MAX_TIME_LIMIT ({most}s)",
                    dag=dag.name,
                    node=node.key,
                )
            if node.soft_time_limit is not None and node.time_limit is None and node.soft_time_limit >= most:
                raise ValidationError(
                    f"soft_time_limit {node.soft_time_limit}s must be below the hard limit that applies,"
                    f" ORCHESTRATOR_MAX_TIME_LIMIT ({most}s): set a time_limit above it or lower it",
                    dag=dag.name,
                    node=node.key,
                )

    # ------------------------------------------------------------------ the worker's calls

    def claim(self, token: FencingToken, worker: str, task_name: str) -> Claim | None:
        """QUEUED -> RUNNING for the token's attempt of a task named ``task_name``, with a
        lease; ``None`` if refused."""
        return self.store.attempts.claim(
            token.run_id, token.key, token.attempt, worker, self.settings.lease_seconds, task_name
        )

    def heartbeat(self, token: FencingToken) -> bool:
        """Extend the attempt's lease; ``False`` once the attempt no longer holds the task."""
        return self.store.attempts.heartbeat(token.run_id, token.key, token.attempt, self.settings.lease_seconds)

    def complete(self, token: FencingToken, result: Any, *, claim: tuple[str, str, float] | None = None) -> Outcome:
        """Commit the attempt's result (fenced), then publish what its children made ready.
        ``claim`` = ``(worker, task_name, elapsed seconds)``: a direct message's body that ran
        unclaimed, claimed in the same transaction."""
        outcome = self.store.attempts.succeed(
            token.run_id, token.key, token.attempt, result, self.settings.dispatch_window, claim=claim
        )
        crash_point("after_result_commit")
        self._after(outcome, token.run_id, token.key)
        return outcome

    def skip_attempt(self, token: FencingToken, reason: str) -> Outcome:
        """Commit the attempt as SKIPPED (fenced; the body raised :class:`orchestrator.Skip`),
        then publish what its children made ready."""
        outcome = self.store.attempts.skip(
            token.run_id, token.key, token.attempt, reason, self.settings.dispatch_window
        )
        self._after(outcome, token.run_id, token.key)
        return outcome

    def fail_attempt(
        self,
        token: FencingToken,
        *,
        error: str,
        exc_types: Sequence[str] = (),
        fingerprint: str | None = None,
        retryable: bool = True,
    ) -> Outcome:
        """Commit a failed attempt (fenced): RETRYING, FAILED or DEAD_LETTER (see
        :meth:`orchestrator.store.attempts.Attempts.fail`), then publish and alert."""
        outcome = self.store.attempts.fail(
            token.run_id, token.key, token.attempt,
            error=error, window=self.settings.dispatch_window, exc_types=exc_types,
            fingerprint=fingerprint, retryable=retryable, actor=WORKER,
        )  # fmt: skip
        self._after(outcome, token.run_id, token.key)
        return outcome

    def defer_attempt(self, token: FencingToken, spec: dict[str, Any]) -> bool:
        """RUNNING -> WAITING for the token's attempt (fenced): the body raised
        :class:`orchestrator.Defer`, or a sensor's check said "not yet" (``spec``: what
        ``orc_defer_v1`` takes). Its slot goes to other READY work at once. Returns whether the
        attempt still held the task (else the refusal is in the ledger)."""
        check_json(spec, "Defer")
        body = json.dumps(spec)
        if len(body) > self.settings.max_event_bytes:
            raise ValidationError(f"Defer: its state exceeds {self.settings.max_event_bytes} bytes of JSON")
        accepted, _, dispatches = self.store.waits.defer(
            token.run_id, token.key, token.attempt, body, self.settings.dispatch_window
        )
        self.publisher.publish(dispatches)
        return accepted

    def register_worker(
        self, name: str, queues: Sequence[str], concurrency: int, tasks: Collection[str] | None = None
    ) -> None:
        """Record a live worker's capacity and the task names it registered (``None``: it does
        not say, and takes every name), and fill it with READY work."""
        self.store.workers.register(name, queues, concurrency, tasks)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))

    def touch_worker(
        self, name: str, queues: Sequence[str], concurrency: int, tasks: Collection[str] | None = None
    ) -> None:
        """Refresh a live worker's capacity row (re-registering it if it was dropped)."""
        if not self.store.workers.touch(name):
            self.store.workers.register(name, queues, concurrency, tasks)

    def drop_unregistered(self, token: FencingToken, worker: str, task_name: str) -> bool:
        """``worker`` received the token's message without ``task_name`` registered: the task is
        held READY until a worker of its queue that has it registers (the watchdog flags it);
        returns whether the row still held that attempt QUEUED."""
        return self.store.workers.drop(self.store.ledger, token.run_id, token.key, token.attempt, worker, task_name)

    def unregister_worker(self, name: str) -> None:
        """A worker is going away: its capacity no longer counts."""
        self.store.workers.unregister(name)

    def live_workers(self) -> int:
        """How many workers are registered and alive."""
        return int(self.store.workers.live())

    def count_delivery(self, message_id: str, task_name: str) -> int:
        """Count one more delivery of a broker message; returns how many there were."""
        return int(self.store.deliveries.count(message_id, task_name))

    def park_delivery(self, message_id: str, evidence: dict[str, Any]) -> None:
        """Record a message parked for too many deliveries, with the evidence."""
        self.store.deliveries.park(message_id, evidence)

    def _after(self, outcome: Outcome, run_id: str, key: str) -> None:
        """After a committed outcome: publish what it admitted, alert if it parked the task."""
        self.publisher.publish(outcome.dispatches)
        if outcome.accepted and outcome.state is TaskState.DEAD_LETTER:
            task = self.store.reads.get_task(run_id, key)
            alert = {
                "run_id": run_id,
                "key": key,
                "task": task.task,
                "attempt": task.attempt,
                "error": task.error,
                "fingerprint": task.fingerprint,
            }
            raise_alert(alert, webhook=self.settings.alert_webhook or None, actor="orchestrator")

    # ------------------------------------------------------------------ reconciler

    def reconcile(self) -> dict[str, int]:
        """One reconciler pass now (see :meth:`orchestrator.services.reconciler.Reconciler.run_pass`)."""
        return self.reconciler.run_pass()

    # ------------------------------------------------------------------ operator actions

    def retry_task(self, run_id: str, key: str, *, by: str | None = None) -> None:
        """DEAD_LETTER or FAILED -> READY with ``attempt + 1``. ``by`` names who asked
        (default: the OS user). Raises :class:`ConflictError` (a rejected event is in the
        ledger) when the task's state does not allow it, whether it never did or another writer
        changed it first, :class:`OperatorError` when children were already decided, and
        :class:`RunNotFound` for a run this orchestrator does not see (nothing written). A wait
        node (``dag.wait``, ``dag.approval``) that FAILED (a timeout, a rejection) waits again
        instead (a clear of it and its downstream: its deadline counts from now)."""
        from ..core.waits import WAIT_TASK

        task = self.task(run_id, key)
        if task.task == WAIT_TASK and task.state in (TaskState.FAILED, TaskState.SKIPPED):
            self.clear(run_id, key, downstream=True, by=by)
            return
        actor = operator(by or local_by())
        self._operator_done(
            self._operator.retry_task(run_id, key, self.settings.dispatch_window, actor), run_id, key, "retry"
        )

    def skip_task(self, run_id: str, key: str, *, by: str | None = None) -> None:
        """DEAD_LETTER -> SKIPPED; descendants follow their trigger rules (errors as :meth:`retry_task`)."""
        self._resolve(run_id, key, TaskState.SKIPPED, by)

    def fail_task(self, run_id: str, key: str, *, by: str | None = None) -> None:
        """DEAD_LETTER -> FAILED (give up); descendants follow (errors as :meth:`retry_task`)."""
        self._resolve(run_id, key, TaskState.FAILED, by)

    def _resolve(self, run_id: str, key: str, to: TaskState, by: str | None) -> None:
        actor = operator(by or local_by())
        outcome = self._operator.resolve_dead_letter(run_id, key, to, self.settings.dispatch_window, actor)
        self._operator_done(outcome, run_id, key, "skip" if to is TaskState.SKIPPED else "fail")

    def _operator_done(self, outcome: Outcome, run_id: str, key: str, action: str) -> None:
        self._after(outcome, run_id, key)
        if not outcome.accepted:
            raise ConflictError(f"{action} of {run_id}.{key} refused: {outcome.conflict or 'the task changed state'}")

    def clear(
        self,
        run_id: str,
        *keys: str,
        downstream: bool = False,
        upstream: bool = False,
        only_failed: bool = False,
        dry_run: bool = False,
        by: str | None = None,
    ) -> list[str]:
        """Send the tasks ``keys`` (with ``downstream``, their descendants; with ``upstream``,
        their ancestors; ``only_failed``: only those FAILED or UPSTREAM_FAILED) back to be run
        again, each with ``attempt + 1`` and a ledger row naming ``by``: a QUEUED or RUNNING
        attempt among them is fenced (its late result is refused and recorded) and revoked, a
        finished run reopens, and what can run is admitted. Returns the keys cleared (with
        ``dry_run``: that would be, nothing written). Raises :class:`TaskNotFound`,
        :class:`RunNotFound`, :class:`OperatorError` (a CANCELLED run, nothing to clear). A map is
        cleared with its children; cleared with the task it maps over, it is expanded again."""
        cleared, fenced, dispatches = self._operator.clear_tasks(
            run_id, list(keys), operator(by or local_by()), self.settings.dispatch_window,
            downstream=downstream, upstream=upstream, only_failed=only_failed, dry_run=dry_run,
        )  # fmt: skip
        self.publisher.publish(dispatches)
        self.publisher.revoke(fenced)
        return cleared

    def mark(self, run_id: str, key: str, state: TaskState | str, *, by: str | None = None) -> TaskState:
        """Set a task's outcome by hand (Airflow's Mark Success / Mark Failed): ``SUCCEEDED``,
        ``FAILED`` or ``SKIPPED`` (or ``success``, ``fail``, ``skip``). Tasks its old outcome had
        decided without running go back to PENDING and its children follow their trigger rules;
        a QUEUED or RUNNING attempt is fenced and revoked; the run reopens or closes as its tasks
        say. Returns the state the task held. Raises as :meth:`clear`."""
        aliases = {"SUCCESS": "SUCCEEDED", "FAIL": "FAILED", "SKIP": "SKIPPED"}
        try:
            to = TaskState(aliases.get(str(state).upper(), str(state).upper()))
        except ValueError:
            raise OperatorError(f"unknown task state {state!r}: mark SUCCEEDED, FAILED or SKIPPED") from None
        held, fenced, dispatches = self._operator.mark_task(
            run_id, key, to, operator(by or local_by()), self.settings.dispatch_window
        )
        self.publisher.publish(dispatches)
        self.publisher.revoke(fenced)
        return TaskState(held)

    def rerun(self, run_id: str) -> RunHandle:
        """A new run of the run's DAG snapshot and params, for its tenant, linked to it
        (``rerun_of``). Raises :class:`RunNotFound`, or :class:`ValidationError` when the DAG no
        longer validates here (a task no longer registered)."""
        first = self.reads.rerun_source(run_id)
        dag = dag_from_spec(first.snapshot)
        handle = self.submit(dag, tenant=first.tenant, dag_version=first.dag_version)
        self.store.submission.link_rerun(handle.id, run_id)
        return handle

    def cancel(self, run_id: str, *, by: str | None = None) -> int:
        """Cancel a run: its open tasks become CANCELLED and the attempts in flight are revoked
        with terminate (their late results are then rejected); the worker slots, pool slots and
        limits they held go to other READY work at once. Returns how many were revoked. A run
        already CANCELLED is no error (0, or what an interrupted cancel had left open). Raises
        :class:`RunNotFound`, or :class:`ConflictError` when the run is SUCCEEDED or FAILED."""
        in_flight, conflict, _ = self._operator.cancel_run(run_id, operator(by or local_by()))
        if conflict is not None:
            raise ConflictError(conflict)
        if in_flight:  # their slots first: the revoke is best effort, the rows are already final
            self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        self.publisher.revoke(in_flight)
        return len(in_flight)

    # ------------------------------------------------------------------ reads

    def set_tenant_weight(self, name: str, weight: float) -> None:
        """A tenant's weight in the fair share of admission (default 1): within a priority class,
        free slots go to the tenant with the fewest tasks in flight per unit of weight. Raises
        :class:`ValidationError` for a bad name or a weight that is not a number in (0, 1000]."""
        self._own_tenant(name)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or not 0 < weight <= 1000
        ):
            raise ValidationError(f"weight {weight!r} must be a number above 0 and at most 1000")
        self.store.tenants.update(name, weight=float(weight))

    def set_tenant_limit(self, name: str, max_running: int | None) -> None:
        """The most tasks of tenant ``name`` QUEUED or RUNNING at once across every queue
        (``None``: no limit), enforced at admission and counted from the task rows, so a slot
        is free again as soon as its task ends, its lease expires or its run is cancelled.
        Raises :class:`ValidationError` for a bad name or a limit that is not 1 to 1,000,000."""
        self._own_tenant(name)
        if max_running is not None and (
            isinstance(max_running, bool) or not isinstance(max_running, int) or not 1 <= max_running <= 1_000_000
        ):
            raise ValidationError(f"max_running {max_running!r} must be an integer from 1 to 1000000")
        self.store.tenants.update(name, max_running=max_running)
        # a raised limit frees slots: fill them now
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))

    def set_tenant_dedicated(self, name: str, dedicated: bool = True) -> None:
        """Give tenant ``name`` its own queues (``orchestrator.tenant.<name>.<priority>``) from
        its next submit on, served by workers started with ``orchestrator worker --tenant
        <name>``; ``dedicated=False`` sends its new runs back to the shared queues. Tenants in
        ``ORCHESTRATOR_DEDICATED_TENANTS`` are dedicated too."""
        self._own_tenant(name)
        self.store.tenants.update(name, dedicated=bool(dedicated))

    def _own_tenant(self, name: str) -> None:
        """Refuse (:class:`ValidationError`) a malformed tenant name, or another tenant's
        settings from an orchestrator bound to a tenant."""
        if not isinstance(name, str) or not TENANT_RE.fullmatch(name):
            raise ValidationError(f"tenant {name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.tenant is not None and name != self.tenant:
            raise ValidationError(f"this orchestrator acts as tenant {self.tenant!r}; it cannot change tenant {name!r}")

    @cached_property
    def schedules(self) -> Schedules:
        """The deployment's schedules (:mod:`orchestrator.schedules`): add, pause, trigger,
        backfill, and the scheduler's pass that ``orchestrator beat`` runs."""
        from ..services.scheduling import Schedules

        return Schedules(self, self.store.schedule_rows.scoped(self.tenant))

    @cached_property
    def triggers(self) -> Triggers:
        """The deployment's event triggers (:mod:`orchestrator.services.triggers`): add, pause, remove,
        and the pass that ``orchestrator beat`` runs."""
        from ..services.triggers import Triggers

        return Triggers(self, self.store.triggers.scoped(self.tenant))

    # ------------------------------------------------------------------ pools and limits

    def set_pool(self, name: str, slots: int, description: str | None = None) -> None:
        """Define or resize the named pool (like an Airflow pool): tasks that name it
        (``pool=``) hold ``pool_slots`` of its slots each while QUEUED or RUNNING, counted from
        the task rows at admission. Deployment-wide: an orchestrator bound to a tenant cannot
        change it. Raises :class:`ValidationError` for a bad name or slot count."""
        self._deployment_wide("pools")
        self.store.limits.set_pool(name, slots, description)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))

    def remove_pool(self, name: str) -> bool:
        """Remove a pool; tasks that still name it wait (``explain`` says so) until it is set again."""
        self._deployment_wide("pools")
        return self.store.limits.remove_pool(name)

    def pools(self) -> list[Pool]:
        return self.store.limits.pools()

    def set_rate_limit(self, key: str, rate: str | float, burst: int | None = None) -> RateLimit:
        """Define or change a deployment-wide token bucket: ``rate`` like ``"10/s"``, ``"600/m"``
        (or tokens per second), ``burst`` its size (default one second's worth, at least 1).
        Tasks that name it (``rate_limit=``) take one token each when admitted, on every
        worker together (Celery's own ``rate_limit`` is per worker process)."""
        self._deployment_wide("rate limits")
        limit = self.store.limits.set_rate_limit(key, rate, burst)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        return limit

    def remove_rate_limit(self, key: str) -> bool:
        """Remove a rate limit; tasks that still name it wait until it is set again."""
        self._deployment_wide("rate limits")
        return self.store.limits.remove_rate_limit(key)

    def rate_limits(self) -> list[RateLimit]:
        return self.store.limits.rate_limits()

    # circuit breakers per resource (store/breakers.py)
    def set_breaker(
        self,
        name: str,
        *,
        window: str | float = 60.0,
        min_calls: int = 20,
        failure_rate: float = 0.5,
        min_failures: int = 5,
        open_for: str | float = "30s..10m",
        probes: int = 1,
        probe_lease: str | float | None = None,
        ramp_max: int = 64,
        failure_on: Sequence[str] = (),
        mode: str = "on",
        by: str | None = None,
    ) -> Breaker:
        """Create or change the circuit breaker of the resource ``name`` (tasks declare
        ``resources=[...]``): it trips when its last ``window`` (``"60s"``) holds at least
        ``min_calls`` calls, ``min_failures`` failures (time-outs, connection errors, the
        exception classes named in ``failure_on``) and a ``failure_rate`` share of failures; open,
        admission holds the resource's READY tasks for ``open_for`` (``"30s..10m"``: doubled per
        consecutive re-open); half-open, ``probes`` leased probes decide; closed again, admission
        ramps up in waves of 1, 2, 4 ... up to ``ramp_max``. ``mode``: on, metrics (counts, never
        holds) or disabled. Deployment-wide."""
        self._deployment_wide("breakers")
        found = self.store.breakers.set(
            name, window=window, min_calls=min_calls, failure_rate=failure_rate, min_failures=min_failures,
            open_for=open_for, probes=probes, probe_lease=probe_lease, ramp_max=ramp_max, failure_on=failure_on,
            mode=mode, by=by or local_by(),
        )  # fmt: skip
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        return found

    def breaker(self, name: str) -> Breaker:
        """The breaker ``name`` now: settings, state, its window's calls and failures, probes out.
        Deployment-wide: a tenant-bound orchestrator is refused (:class:`ValidationError`)."""
        return self.store.breakers.scoped(self.tenant).get(name)

    def breakers(self) -> list[Breaker]:
        return self.store.breakers.scoped(self.tenant).find()

    def breaker_events(self, name: str | None = None, *, limit: int = 100) -> list[BreakerEvent]:
        """The breakers' ledger (every state change and operator action, with who), oldest first."""
        return self.store.breakers.scoped(self.tenant).events(name, limit=limit)

    def open_breaker(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Force the breaker open (its resource's READY tasks are held) until :meth:`close_breaker`."""
        self._deployment_wide("breakers")
        return self.store.breakers.open(name, by=by or local_by(), reason=reason)

    def close_breaker(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Close the breaker now (no ramp) and turn it back on; its held tasks are admitted."""
        self._deployment_wide("breakers")
        found = self.store.breakers.close(name, by=by or local_by(), reason=reason)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        return found

    def disable_breaker(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """The breaker never trips and counts nothing (until set or closed again)."""
        self._deployment_wide("breakers")
        found = self.store.breakers.disable(name, by=by or local_by(), reason=reason)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        return found

    def remove_breaker(self, name: str, *, by: str | None = None) -> bool:
        """Remove the breaker: its resource's tasks are no longer counted nor held."""
        self._deployment_wide("breakers")
        gone = self.store.breakers.remove(name, by=by or local_by())
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))
        return gone

    def set_dag_limit(self, dag_name: str, max_running: int | None, *, tenant: str | None = None) -> None:
        """The most tasks QUEUED or RUNNING at once across every run of one tenant's DAG
        (``None``: no limit); ``tenant`` defaults to the bound tenant, else ``default``. (A
        single run's limit is the DAG's ``max_active_tasks``.)"""
        name = tenant or self.tenant or "default"
        self._own_tenant(name)
        self.store.limits.set_dag_limit(name, dag_name, max_running)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))

    def dag_limits(self) -> dict[tuple[str, str], int]:
        """``{(tenant, DAG name): max_running}`` (the bound tenant's only, when bound)."""
        return self.store.limits.dag_limits(self.tenant)

    def _deployment_wide(self, what: str) -> None:
        if self.tenant is not None:
            raise ValidationError(
                f"{what} are deployment-wide: this orchestrator acts as tenant {self.tenant!r} and cannot change them"
            )

    def tenant_settings(self) -> dict[str, tuple[float, int | None, bool]]:
        """``{tenant: (weight, max_running, dedicated)}`` of the tenants configured so far (a
        tenant-bound orchestrator sees its own entry only)."""
        found = self.store.tenants.settings()
        if self.tenant is not None:
            return {name: v for name, v in found.items() if name == self.tenant}
        return found

    def explain(self, run_id: str, key: str | None = None, *, keys: Collection[str] | None = None) -> list[Explanation]:
        """Why each task of the run (or only ``key``, or only ``keys``) is where it is: see
        :mod:`orchestrator.core.explain`. Raises :class:`RunNotFound`, or :class:`TaskNotFound` for
        a ``key`` the run does not have. Only the named tasks and their parents are read."""
        s = self.settings
        scope = {key} if key is not None else keys
        data = self.reads.explain_input(run_id, worker_ttl=s.worker_ttl, depth=s.dispatch_depth, keys=scope)
        found = explain(data, key)
        if keys is not None:
            found = [e for e in found if e.key in keys]
        if key is not None and not found:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return found

    def visible(self, run_id: str) -> RunView:
        """The run, if this orchestrator may see it; :class:`RunNotFound` otherwise (a run of
        another tenant is not found, exactly like a run that does not exist)."""
        return self.reads.get_run(run_id)

    def tasks(self, run_id: str) -> list[TaskView]:
        """The run's tasks; raises :class:`RunNotFound`."""
        return self.reads.get_tasks(run_id)

    def task(self, run_id: str, key: str) -> TaskView:
        """One task of the run; raises :class:`RunNotFound` or :class:`TaskNotFound`."""
        return self.reads.get_task(run_id, key)

    def events(self, run_id: str, *, newest: int | None = None) -> list[EventView]:
        """The run's ledger, oldest first (only the ``newest`` rows when given); raises
        :class:`RunNotFound`."""
        return self.reads.events(run_id, newest=newest)

    def edges(self, run_id: str) -> list[tuple[str, str]]:
        """The run's dependency edges (parent key, child key); raises :class:`RunNotFound`."""
        return self.reads.edges(run_id)

    def logical_date(self, run_id: str) -> str | None:
        """The run's logical date (ISO 8601), or ``None`` (also for a run it does not see)."""
        return self.reads.logical_date(run_id)

    def run_state(self, run_id: str) -> RunState:
        """The run's state (one row by primary key); raises :class:`RunNotFound`."""
        return self.reads.run_state(run_id)

    def verify(
        self, run_ids: Sequence[str], *, allow_dead_letter: bool = False, in_progress_ok: bool = False
    ) -> list[str]:
        """The promise checked from the database for ``run_ids`` (see
        :func:`orchestrator.services.invariants.check_runs`): one line per violation. Raises
        :class:`RunNotFound` for a run this orchestrator does not see, before checking any."""
        from ..services.invariants import check_runs

        ids = list(run_ids)
        for run_id in ids:
            self.reads.run_state(run_id)  # RunNotFound for a run it does not see
        return check_runs(self.store, ids, allow_dead_letter=allow_dead_letter, in_progress_ok=in_progress_ok)

    def metrics_snapshot(self, *, window_seconds: float, max_events: int) -> MetricsSnapshot:
        """What :mod:`orchestrator.web.metrics` exposes, as this orchestrator may see it: a bound
        one its tenant's tasks, ledger and schedules, without the deployment's workers and
        reconciler duty (see :meth:`~orchestrator.store.reads.Reads.metrics_snapshot`)."""
        return self.reads.metrics_snapshot(
            window_seconds=window_seconds, max_events=max_events, worker_ttl=self.settings.worker_ttl
        )

    def run(self, run_id: str) -> RunHandle:
        """A handle on a run this orchestrator may see; raises :class:`RunNotFound`."""
        self.visible(run_id)
        return RunHandle(self, run_id)

    def runs(
        self,
        limit: int = 20,
        tenant: str | None = None,
        *,
        dag: str | None = None,
        state: RunState | str | None = None,
        offset: int = 0,
        dag_version: int | None = None,
    ) -> list[RunView]:
        """Recent runs, newest first: of ``tenant``, or of every tenant; a bound orchestrator
        lists its own tenant's only. ``dag``, ``dag_version`` (the registered version a run was
        made from; with ``dag``) and ``state`` filter, ``offset`` pages back."""
        if isinstance(state, str):
            try:
                state = RunState(state.upper())
            except ValueError:
                raise ValidationError(f"unknown run state {state!r}; one of {', '.join(RunState)}") from None
        if limit < 1 or offset < 0:
            raise ValidationError("limit must be at least 1 and offset not negative")
        if dag_version is not None and dag is None:
            raise ValidationError("a version filter needs the DAG's name (dag=)")
        return self.reads.list_runs(limit, tenant=tenant, dag=dag, state=state, offset=offset, dag_version=dag_version)


class RunHandle:
    """A submitted run: ``id``, ``status()``, ``tasks()``, ``wait()``, ``results()``;
    ``warnings``: what :meth:`DAG.lint` found when it was submitted (likely mistakes that are
    still valid, such as a join below a branch that keeps ``all_success``)."""

    def __init__(self, orchestrator: Orchestrator, run_id: str, *, warnings: list[str] | None = None) -> None:
        self.orchestrator = orchestrator
        self.id = run_id
        self.warnings: list[str] = list(warnings or [])

    def __repr__(self) -> str:
        return f"<RunHandle {self.id}>"

    def status(self) -> RunView:
        return self.orchestrator.visible(self.id)

    @property
    def state(self) -> RunState:
        return self.orchestrator.run_state(self.id)

    def tasks(self) -> list[TaskView]:
        return self.orchestrator.tasks(self.id)

    def task(self, key: str) -> TaskView:
        return self.orchestrator.task(self.id, key)

    def events(self) -> list[EventView]:
        return self.orchestrator.events(self.id)

    def cancel(self, *, by: str | None = None) -> int:
        return self.orchestrator.cancel(self.id, by=by)

    def retry(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.retry_task(self.id, key, by=by)

    def skip(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.skip_task(self.id, key, by=by)

    def clear(
        self,
        *keys: str,
        downstream: bool = False,
        upstream: bool = False,
        only_failed: bool = False,
        by: str | None = None,
    ) -> list[str]:
        """:meth:`Orchestrator.clear` on this run."""
        return self.orchestrator.clear(
            self.id, *keys, downstream=downstream, upstream=upstream, only_failed=only_failed, by=by
        )

    def mark(self, key: str, state: TaskState | str, *, by: str | None = None) -> TaskState:
        """:meth:`Orchestrator.mark` on this run."""
        return self.orchestrator.mark(self.id, key, state, by=by)

    def rerun(self) -> RunHandle:
        """:meth:`Orchestrator.rerun` of this run."""
        return self.orchestrator.rerun(self.id)

    def fail(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.fail_task(self.id, key, by=by)

    def signal(self, name: str, payload: dict[str, Any] | None = None, *, event_id: str | None = None) -> Emitted:
        """Send the signal ``name`` to this run (see :meth:`Orchestrator.signal`)."""
        return self.orchestrator.signal(self.id, name, payload, event_id=event_id)

    def approve(self, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Approve this run's approval node ``key`` (see :meth:`Orchestrator.approve`)."""
        self.orchestrator.approve(self.id, key, by=by, comment=comment)

    def reject(self, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Reject this run's approval node ``key`` (see :meth:`Orchestrator.reject`)."""
        self.orchestrator.reject(self.id, key, by=by, comment=comment)

    def results(self) -> dict[str, Any]:
        """The stored JSON result of every task that succeeded, by node key."""
        return {t.key: t.result for t in self.tasks() if t.state.value == "SUCCEEDED"}

    def wait(self, timeout: float | None = None, *, poll: float = 0.1) -> RunView:
        """Block until the run is final; raise :class:`RunTimeout` after ``timeout`` seconds.
        A database outage (a lost or refused connection) is waited out, logged, until then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.state.terminal:  # one row by primary key per poll; the counts once, at the end
                    return self.status()
            except Exception as exc:
                if not self.orchestrator.is_transient(exc):
                    raise
                log.warning("waiting for run %s: the database is unreachable (%s); still waiting", self.id, exc)
            if deadline is not None and time.monotonic() >= deadline:
                raise RunTimeout(f"run {self.id} still running after {timeout}s")
            time.sleep(poll)


__all__ = ["Actor", "Orchestrator", "RunHandle", "local_by", "os_user"]
