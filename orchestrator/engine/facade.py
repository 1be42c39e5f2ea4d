"""The orchestrator facade: submit DAGs, approvals, operator actions, reads, and one sub-object
per concern.

:class:`Orchestrator` is the one object applications, workers, the reconciler and the CLI
talk to. It owns no Celery code: messages leave through a :class:`~orchestrator.core.publisher.Publisher`
and task names are checked against a :class:`~orchestrator.core.registry.TaskRegistry`, both given
by the caller (``app=`` wires the Celery ones; unit tests pass in-memory ones).

Its API has one shape: the run-level calls are methods (``submit``, ``run``, ``cancel``,
``clear``, ``explain``...; the worker's calls come from :class:`~orchestrator.engine.worker_port.WorkerPort`),
and every other concern is a sub-object with its own verbs: ``orc.schedules``, ``orc.triggers``,
``orc.dags``, ``orc.limits``, ``orc.breakers``, ``orc.tenants``, ``orc.events``, ``orc.bulk``.

It is the wall around the store for applications, with known exceptions inside the package
that take ``Orchestrator.store`` directly: the sub-objects of this folder, the DAG registry
(``services.dag_registry``: its rows), the reconciler service (its duty connection), the web
app (one orchestrator per tenant over the same store), ``orchestrator db clean`` (the store's
cleanup) and the test kit and chaos soak (their connections). Bound to a tenant, it reads and
acts through the store's roles scoped to that tenant (``Reads.scoped``, ``OperatorActions.scoped``,
``ScheduleRows.scoped``, ``Breakers.scoped``), so a run or a schedule of another tenant is not
found wherever it is asked for, by whichever caller.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Unpack

from ..core.config import Settings
from ..core.dag import (
    DAG,
    TENANT_RE,
    dag_from_spec,
)
from ..core.dag.transactional import check_limits as check_transactional
from ..core.errors import ConfigurationError, ConflictError, OperatorError, TaskNotFound, ValidationError
from ..core.explain import Explanation, explain
from ..core.flow import FlowOptions
from ..core.models import (
    Actor,
    EventView,
    MetricsSnapshot,
    Outcome,
    ProgressView,
    RunView,
    TaskView,
    operator,
)
from ..core.publisher import CeleryPublisher, Publisher
from ..core.registry import CeleryRegistry, TaskRegistry
from ..core.routing import DEFAULT_TENANT
from ..core.states import RunState, TaskState
from ..core.tags import check_tags
from ..services.reconciler import Reconciler
from ..store import Store
from ..store.operator import OperatorActions
from ..store.reads import Reads
from .breakers import Breakers
from .bulk import Bulk
from .checks import check_queues, check_time_limits
from .children import ChildRuns
from .events import Events
from .flow import held_reasons
from .flow import release as release_held
from .limits import Limits
from .runs import RunHandle
from .scope import local_by
from .submitting import submit_run
from .tenants import Tenants
from .worker_port import WorkerPort

if TYPE_CHECKING:
    from ..services.dag_registry import DagRegistry, DagVersion
    from ..services.scheduling import Schedules
    from ..services.triggers import Triggers

log = logging.getLogger(__name__)


class Orchestrator(WorkerPort):
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
        self.publisher: Publisher = publisher or CeleryPublisher(
            app, lambda: self.store.signing_key, trace_read=lambda ids: self.store.reads.trace_contexts(ids)
        )
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
            children=lambda: self.children.tick(), flow=lambda: release_held(self),
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
        code_version: str | None = None,
        tags: Mapping[str, str] | None = None,
        **flow: Unpack[FlowOptions],
    ) -> RunHandle:
        """Validate ``dag`` (a :class:`DAG`, or a Celery canvas: :meth:`DAG.from_canvas`), store it
        as a run in one transaction, then admit and publish
        what live workers can take (a second transaction, after the run is committed).

        Idempotent on (DAG name, tenant, ``idempotency_key``): the same key returns the
        handle of the run it created first; and on (``schedule``, ``logical_date``): the
        scheduler's firings and backfills create one run per instant however often they try.
        ``schedule`` (the scheduler's, :mod:`orchestrator.schedules`) must name an existing
        schedule of the run's tenant, with a ``logical_date``. ``dag_version`` is the registered
        version the DAG was built from (:meth:`submit_registered`, a schedule on a registered DAG;
        recorded on the run). ``trigger`` names the event trigger that started the run
        (:mod:`orchestrator.services.triggers`; recorded on the run). ``code_version`` pins the
        run to workers advertising that code version (their ``QUEUE@VERSION`` queues). The run
        keeps the caller's trace context (OpenTelemetry's, when installed): every message of the
        run carries it. ``tags`` label the run (``{"customer": "42"}``: :mod:`orchestrator.core.tags`;
        kept by its reruns; filtered by :meth:`runs` and :attr:`bulk`). A run by hand of a DAG that is
        registered and paused still runs; its handle's ``warnings`` say so. ``concurrency_key``,
        ``max_concurrent``, ``on_busy``, ``throttle``, ``debounce``, ``max_wait``: keyed flow control
        (:mod:`orchestrator.core.flow`; a held or skipped run's handle says so in ``warnings``). Raises
        :class:`ValidationError` (nothing is written or published) for bad input.
        """
        return submit_run(
            self, dag, idempotency_key=idempotency_key, tenant=tenant, logical_date=logical_date,
            schedule=schedule, dag_version=dag_version, trigger=trigger, code_version=code_version, tags=tags,
            flow_options=flow,
        )  # fmt: skip

    # ------------------------------------------------------------------ approvals

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
                if asked is not None and asked not in (self.tenant, DEFAULT_TENANT):
                    raise ValidationError(
                        f"this orchestrator acts as tenant {self.tenant!r}; it cannot submit for tenant {asked!r}",
                        dag=dag.name if isinstance(dag.name, str) else None,
                    )
            tenant = self.tenant
        if tenant is not None and tenant != dag.tenant:
            dag = dag.with_tenant(tenant)
        dag.validate(self.registry.is_registered, self.settings.limits)
        check_queues(dag)
        check_time_limits(dag, self.settings.max_time_limit)
        check_transactional(dag.name, dag.nodes.values(), self.settings.lease_seconds, self.settings.max_time_limit)
        self.store.limits.check_dag(dag)
        if any(getattr(n, "child", None) is not None for n in dag.nodes.values()):
            self.children.check(dag)
        return dag

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
        from ..core.children import CHILD_TASK
        from ..core.waits import WAIT_TASK

        task = self.task(run_id, key)
        if task.task in (WAIT_TASK, CHILD_TASK) and task.state in (TaskState.FAILED, TaskState.SKIPPED):
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
        setup: bool = True,
    ) -> list[str]:
        """Send the tasks ``keys`` (with ``downstream``, their descendants; with ``upstream``,
        their ancestors; with ``setup``, as Airflow's clear, the setups whose scope holds them and
        those setups' teardowns; ``only_failed``: only those FAILED or UPSTREAM_FAILED) back to be run
        again, each with ``attempt + 1`` and a ledger row naming ``by``: a QUEUED or RUNNING
        attempt among them is fenced (its late result is refused and recorded) and revoked, a
        finished run reopens, and what can run is admitted. Returns the keys cleared (with
        ``dry_run``: that would be, nothing written). Raises :class:`TaskNotFound`,
        :class:`RunNotFound`, :class:`OperatorError` (a CANCELLED run, nothing to clear). A map is
        cleared with its children; cleared with the task it maps over, it is expanded again."""
        cleared, fenced, dispatches = self._operator.clear_tasks(
            run_id, list(keys), operator(by or local_by()), self.settings.dispatch_window,
            downstream=downstream, upstream=upstream, only_failed=only_failed, dry_run=dry_run, setup=setup,
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
        """A new run of the run's DAG snapshot, params and tags, for its tenant, linked to it
        (``rerun_of``). Raises :class:`RunNotFound`, or :class:`ValidationError` when the DAG no
        longer validates here (a task no longer registered)."""
        first = self.reads.rerun_source(run_id)
        dag = dag_from_spec(first.snapshot)
        handle = self.submit(dag, tenant=first.tenant, dag_version=first.dag_version, tags=first.tags or None)
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

    # ------------------------------------------------------------------ the concerns, one sub-object each

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

    @cached_property
    def limits(self) -> Limits:
        """Pools, rate limits and per-DAG limits (:mod:`orchestrator.engine.limits`)."""
        return Limits(self)

    @cached_property
    def breakers(self) -> Breakers:
        """Circuit breakers per resource (:mod:`orchestrator.engine.breakers`)."""
        return Breakers(self)

    @cached_property
    def tenants(self) -> Tenants:
        """Tenants' weights, limits and dedicated queues (:mod:`orchestrator.engine.tenants`)."""
        return Tenants(self)

    @cached_property
    def bulk(self) -> Bulk:
        """Cancel, retry or rerun every run a filter selects (:mod:`orchestrator.engine.bulk`)."""
        return Bulk(self)

    @cached_property
    def children(self) -> ChildRuns:
        """Child runs (:mod:`orchestrator.engine.children`): the child pass, the submit checks, lineage."""
        return ChildRuns(self)

    @cached_property
    def events(self) -> Events:
        """Events from outside and signals to a run (:mod:`orchestrator.engine.events`)."""
        return Events(self)

    # ------------------------------------------------------------------ reads

    def explain(self, run_id: str, key: str | None = None, *, keys: Collection[str] | None = None) -> list[Explanation]:
        """Why each task of the run (or only ``key``, or only ``keys``) is where it is: see
        :mod:`orchestrator.core.explain`. Raises :class:`RunNotFound`, or :class:`TaskNotFound` for
        a ``key`` the run does not have. Only the named tasks and their parents are read."""
        s = self.settings
        scope = {key} if key is not None else keys
        data = self.reads.explain_input(run_id, worker_ttl=s.worker_ttl, depth=s.dispatch_depth, keys=scope)
        found = held_reasons(self, run_id, explain(data, key))  # a run keyed flow control holds: why
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

    def progress(self, run_id: str) -> dict[str, ProgressView]:
        """The latest progress each task's current attempt reported (``update_state``), by key;
        raises :class:`RunNotFound`."""
        return self.reads.progress(run_id)

    def task(self, run_id: str, key: str) -> TaskView:
        """One task of the run; raises :class:`RunNotFound` or :class:`TaskNotFound`."""
        return self.reads.get_task(run_id, key)

    def ledger(self, run_id: str, *, newest: int | None = None) -> list[EventView]:
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
        tags: Mapping[str, str] | None = None,
    ) -> list[RunView]:
        """Recent runs, newest first: of ``tenant``, or of every tenant; a bound orchestrator
        lists its own tenant's only. ``dag``, ``dag_version`` (the registered version a run was
        made from; with ``dag``), ``state`` and ``tags`` (runs holding every one) filter,
        ``offset`` pages back. Raises :class:`ValidationError` (:class:`TagError`) for a bad filter."""
        tags = check_tags(tags, what="the tag filter")
        if isinstance(state, str):
            try:
                state = RunState(state.upper())
            except ValueError:
                raise ValidationError(f"unknown run state {state!r}; one of {', '.join(RunState)}") from None
        if limit < 1 or offset < 0:
            raise ValidationError("limit must be at least 1 and offset not negative")
        if dag_version is not None and dag is None:
            raise ValidationError("a version filter needs the DAG's name (dag=)")
        return self.reads.list_runs(
            limit, tenant=tenant, dag=dag, state=state, offset=offset, dag_version=dag_version, tags=tags
        )


__all__ = ["Actor", "Orchestrator", "RunHandle", "local_by"]
