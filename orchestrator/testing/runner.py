"""Runs a DAG in the test's process through the production transitions.

The :class:`Kit` is a deployment in one process: an :class:`~orchestrator.engine.facade.Orchestrator` on
the kit's database whose publisher is an in-process queue (:class:`InProcessPublisher`) instead
of a broker, one registered worker (``kit@orchestrator-testing``) that takes the queue's
messages one at a time and runs each through Celery's tracer and the task's own
:class:`~orchestrator.runtime.worker.OrchestratedTask` code (signature check, claim, body, fenced
outcome: what a pool process runs), and the reconciler's pass between them. The arguments of
every message go through the app's serializer (JSON) and back, results through the worker's
JSON check and the database, so what would not cross a broker or the database fails here too.

Time is the database's (:mod:`orchestrator.testing.clock`): when the run can only wait for an
instant (a retry's backoff, a sleep, a wait's or sensor's next check, a deadline, a lost message's
dispatch timeout, a dead worker's lease), the clock jumps to it and the reconciler's pass
releases what fell due; no real time passes.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from ..core import protocol
from ..core.config import Settings
from ..core.dag import DAG
from ..core.errors import OrchestratorError
from ..core.models import Dispatch
from ..core.routing import default_queues
from ..core.states import TERMINAL, RunState, TaskState
from ..engine.facade import Orchestrator, RunHandle
from ..runtime import process
from ..store import schema as s
from ..store.waits import Emitted
from .app import InProcessPublisher, KitTasks, _elsewhere, _kit_app, kit_app, kit_settings  # noqa: F401
from .clock import Clock
from .database import KitDatabase
from .inputs import (
    CrashWorker,
    FailTimes,
    Fault,
    Input,
    KitError,
    LoseDispatch,
    _faults,
)
from .results import Delivery, RunResult, _run_id

log = logging.getLogger(__name__)

#: the in-process worker's name (the registry's row, the tasks' ``worker``)
WORKER = "kit@orchestrator-testing"
#: its capacity: every admitted task is QUEUED at once, and run in admission order
CONCURRENCY = 1000
#: idle points (clock jumps, inputs delivered) one drive may take before it gives up
MAX_IDLE_STEPS = 2000
#: how far one drive may move the clock by itself
MAX_ADVANCE = dt.timedelta(days=400)
#: past a due instant by this much when the clock jumps to it (``<`` comparisons)
NUDGE = dt.timedelta(milliseconds=1)


# ---------------------------------------------------------------------------------- faults


# ---------------------------------------------------------------------------------- inputs


# ---------------------------------------------------------------------------------- plumbing


# ---------------------------------------------------------------------------------- the result


# ---------------------------------------------------------------------------------- the kit


class Kit:
    """A deployment in the test's process on the kit's database (see the module docstring).

    ``app`` is the Celery app whose tasks the DAGs name (default: the project's,
    ``orchestrator.runtime.celery_app.get_app()``); ``settings`` default to :func:`kit_settings`."""

    def __init__(self, db: KitDatabase, *, app: Any = None, settings: Settings | None = None) -> None:
        self.db = db
        self.clock: Clock = db.clock
        self.settings = settings or kit_settings(db.url)
        self.publisher = InProcessPublisher()
        self.tasks = KitTasks(app)
        self.orc = Orchestrator(
            self.settings, store=db.store(self.settings), publisher=self.publisher, registry=self.tasks
        )
        self.faults: dict[str, list[Fault]] = {}
        #: every message the kit's worker took, in order
        self.deliveries: list[Delivery] = []
        self._queues: set[str] = set()
        self._installed: dict[tuple[int, int], Orchestrator | None] = {}
        self._tracers: dict[int, Any] = {}
        self._inputs: list[Input] = []
        # the process's heartbeater (the worker's lease extensions) beats through this database
        from ..runtime.heartbeat import install_heartbeater

        self._heartbeater_was = install_heartbeater(db.heartbeater(self.orc))

    # -------------------------------------------------------------- the test's verbs

    def run_dag(
        self,
        dag: DAG,
        *,
        clock: Clock | dt.datetime | None = None,
        faults: Mapping[str, Fault | Sequence[Fault]] | None = None,
        events: Iterable[Input] = (),
        auto_advance: bool = True,
        tasks: Mapping[str, Any] | None = None,
        **submit: Any,
    ) -> RunResult:
        """Submit ``dag`` and drive it until it is final or can only wait for what no input and
        no instant brings; see :func:`orchestrator.testing.run_dag`."""
        if isinstance(clock, dt.datetime):
            self.clock.set(clock)
        elif clock is not None and clock is not self.clock and getattr(clock, "engine", None) is not self.db.engine:
            raise KitError("clock= is this test's clock (orchestrator.clock) or a datetime to start at")
        chosen = _faults(faults)
        events = list(events)
        names = set(dag.nodes) | {n.task for n in dag.nodes.values()}
        unknown = sorted(set(chosen) - names) + sorted(
            i.key for i in events if i.kind in ("approve", "reject") and i.key not in dag.nodes
        )
        if unknown:
            raise KitError(f"{unknown} name no node key or task name of DAG {dag.name!r} (a typo tests nothing)")
        self.faults.update(chosen)
        self.tasks.override(tasks)
        self._register(dag)
        started = self.clock.now()
        handle = self.orc.submit(dag, **submit)
        return self.drive(handle.id, events=events, auto_advance=auto_advance, started_at=started)

    def submit(self, dag: DAG, **options: Any) -> RunHandle:
        """Submit without driving (then :meth:`drive` or ``RunResult.resume``)."""
        self._register(dag)
        return self.orc.submit(dag, **options)

    def emit(self, key: str, payload: dict[str, Any] | None = None, **options: Any) -> Emitted:
        """Emit an event now (:meth:`Orchestrator.emit`); ``resume()`` a run to let it act on it."""
        return self.orc.events.emit(key, payload, **options)

    def signal(self, run: Any, name: str, payload: dict[str, Any] | None = None, **options: Any) -> Emitted:
        """Signal a run now (:meth:`Orchestrator.signal`)."""
        return self.orc.events.signal(_run_id(run), name, payload, **options)

    def approve(self, run: Any, key: str, *, by: str = "test", comment: str | None = None) -> None:
        """Approve a run's approval node now (:meth:`Orchestrator.approve`)."""
        self.orc.approve(_run_id(run), key, by=by, comment=comment)

    def reject(self, run: Any, key: str, *, by: str = "test", comment: str | None = None) -> None:
        self.orc.reject(_run_id(run), key, by=by, comment=comment)

    def reconcile(self) -> dict[str, int]:
        """One reconciler pass now (the kit's worker counted alive at the clock's now)."""
        self.orc.touch_worker(WORKER, sorted(self._queues), CONCURRENCY)
        return self.orc.reconcile()

    def result(self, run: Any, *, started_at: dt.datetime | None = None) -> RunResult:
        """A snapshot of a run."""
        run_id = _run_id(run)
        view = self.orc.visible(run_id)
        return RunResult(
            run_id=run_id,
            state=view.state,
            tasks=self.orc.tasks(run_id),
            ledger=self.orc.ledger(run_id),
            deliveries=[d for d in self.deliveries if d.run_id == run_id],
            started_at=started_at or view.created_at or self.clock.now(),
            now=self.clock.now(),
            kit=self,
        )

    # -------------------------------------------------------------- driving

    def drive(
        self,
        run: Any,
        *,
        events: Iterable[Input] = (),
        auto_advance: bool = True,
        started_at: dt.datetime | None = None,
    ) -> RunResult:
        """Run every message, reconcile, deliver the inputs and (``auto_advance``) jump the
        clock to the next instant something waits for, until the run is final or nothing
        more can happen; returns its snapshot."""
        run_id = _run_id(run)
        started = started_at or self.orc.visible(run_id).created_at or self.clock.now()
        self._inputs.extend(events)
        horizon = self.clock.now() + MAX_ADVANCE
        for _ in range(MAX_IDLE_STEPS):
            self._settle()
            if self.orc.run_state(run_id).terminal:
                break
            if self._give_input(run_id, started, force=False):
                continue
            if auto_advance:
                due = self._next_instant(started)
                if due is not None and due <= horizon:
                    self.clock.advance_to(due + NUDGE)
                    continue
            if self._give_input(run_id, started, force=True):
                continue
            break
        else:
            raise KitError(
                f"run {run_id} did not settle after {MAX_IDLE_STEPS} jumps of the clock and inputs:\n"
                + self.result(run_id, started_at=started).explain()
            )
        return self.result(run_id, started_at=started)

    def _settle(self) -> None:
        """Deliver every message, then reconcile, until a pass publishes nothing."""
        while True:
            while self.publisher.queue:
                self._deliver(self.publisher.queue.popleft())
            self.reconcile()
            if not self.publisher.queue:
                return

    def _next_instant(self, started: dt.datetime) -> dt.datetime | None:
        """The earliest instant something waits for: a retry's ``not_before``, a wait's wake,
        a lease's end (a worker that died), a lost message's dispatch timeout, a deadline, a
        timed input; ``None`` when nothing waits for time."""
        t, r = s.tasks.c, s.runs.c
        terminal = [st.value for st in TERMINAL]
        timeout = sa.func.make_interval(0, 0, 0, 0, 0, 0, self.settings.dispatch_timeout)
        queries = [
            sa.select(sa.func.min(t.not_before)).where(t.state == TaskState.RETRYING.value),
            sa.select(sa.func.min(t.wake_at)).where(t.state == TaskState.WAITING.value),
            sa.select(sa.func.min(t.lease_expires_at)).where(t.state == TaskState.RUNNING.value),
            sa.select(sa.func.min(t.dispatched_at) + timeout).where(t.state == TaskState.QUEUED.value),
            sa.select(sa.func.min(t.deadline_at)).where(
                t.deadline_at.is_not(None), t.deadline_checked_at.is_(None), t.state.not_in(terminal)
            ),
            sa.select(sa.func.min(r.deadline_at)).where(
                r.deadline_at.is_not(None), r.deadline_checked_at.is_(None), r.state == RunState.RUNNING.value
            ),
        ]
        with self.db.engine.connect() as conn:
            found = [conn.execute(q).scalar() for q in queries]
        found += [started + dt.timedelta(seconds=i.after) for i in self._inputs if i.after is not None]
        instants = [f for f in found if f is not None]
        return min(instants) if instants else None

    def _give_input(self, run_id: str, started: dt.datetime, *, force: bool) -> bool:
        """Deliver the first input that is due: timed, its instant reached; untimed, something
        waits for it (with ``force``: the first untimed one, whatever waits)."""
        if not self._inputs:
            return False
        now = self.clock.now()
        waiting = self._waiting(run_id)
        for i, item in enumerate(self._inputs):
            if item.after is not None:
                due = started + dt.timedelta(seconds=item.after) <= now
            elif force:
                due = True
            elif item.kind in ("approve", "reject"):
                due = waiting.get(item.key) == "approval"
            else:
                due = item.key in waiting.values() or any(
                    e == item.key for e in self._waited_events(run_id if item.kind == "signal" else None)
                )
            if due:
                del self._inputs[i]
                self._apply(run_id, item)
                return True
        return False

    def _waiting(self, run_id: str) -> dict[str, str]:
        """The run's WAITING tasks: key -> what they wait for (``approval``, ``sleep``, ...)."""
        t = s.tasks.c
        with self.db.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.key, t.waiting).where(t.run_id == run_id, t.state == TaskState.WAITING.value)
            ).all()
        return {row.key: str((row.waiting or {}).get("kind")) for row in rows}

    def _waited_events(self, run_id: str | None) -> list[str]:
        """Event keys WAITING tasks wait for (of one run, or of every run)."""
        t = s.tasks.c
        query = sa.select(t.wait_event).where(t.state == TaskState.WAITING.value, t.wait_event.is_not(None))
        if run_id is not None:
            query = query.where(t.run_id == run_id)
        with self.db.engine.connect() as conn:
            return [str(k) for k in conn.execute(query).scalars()]

    def _apply(self, run_id: str, item: Input) -> None:
        """Deliver one input (an event for the run's tenant unless it names one)."""
        try:
            if item.kind == "emit":
                tenant = item.tenant or self.orc.visible(run_id).tenant
                self.orc.events.emit(item.key, item.payload, event_id=item.event_id, tenant=tenant)
            elif item.kind == "signal":
                self.orc.events.signal(run_id, item.key, item.payload, event_id=item.event_id)
            elif item.kind == "approve":
                self.orc.approve(run_id, item.key, by=item.by, comment=item.comment)
            else:
                self.orc.reject(run_id, item.key, by=item.by, comment=item.comment)
        except OrchestratorError as exc:
            raise KitError(
                f"the input {item.kind}({item.key!r}) could not be delivered: {exc}\n" + self.result(run_id).explain()
            ) from exc

    # -------------------------------------------------------------- the worker

    def _register(self, dag: DAG) -> None:
        """Count the kit's worker as consuming every queue the DAG's nodes may be routed to."""
        dedicated = set(self.settings.dedicated_tenants) | set(self.orc.store.tenants.dedicated())
        queues = set(default_queues(sorted(dedicated))) | {n.queue for n in dag.nodes.values() if n.queue}
        if not queues <= self._queues:
            self._queues |= queues
            self.orc.register_worker(WORKER, sorted(self._queues), CONCURRENCY)

    def _fault(self, d: Dispatch) -> Fault | None:
        names = [d.key]
        if "[" in d.key:
            names.append(d.key.split("[", 1)[0])  # a map's child: its map's faults
        names.append(d.task_name)
        for name in names:
            for f in self.faults.get(name, ()):
                if f.take():
                    return f
        return None

    def _install(self, app: Any) -> None:
        """Make this kit's orchestrator the one ``app``'s tasks find in this process."""
        ident = (os.getpid(), id(app))
        if ident not in self._installed:
            self._installed[ident] = process._orchestrators.get(ident)
        process._orchestrators[ident] = self.orc

    def _deliver(self, d: Dispatch) -> None:
        def record(outcome: str) -> None:
            self.deliveries.append(Delivery(d.run_id, d.key, d.attempt, d.task_name, outcome))

        if d.token.task_id in self.publisher.revoked:
            record("revoked")
            return
        task = self.tasks.get(d.task_name)
        if task is None:
            raise KitError(f"no task named {d.task_name!r} (node {d.key!r}) in the kit's registry")
        fault = self._fault(d)
        if isinstance(fault, LoseDispatch):
            record("lost")
            return
        self._install(task.app)
        if isinstance(fault, CrashWorker):
            self.orc.claim(d.token, f"{WORKER}:crashed", d.task_name)
            record("crashed")
            return
        args, kwargs = roundtrip(task.app, d)
        request = message_request(self.orc.signing_key, d, args, kwargs)
        patched = "run" in task.__dict__
        saved = task.__dict__.get("run")
        if isinstance(fault, FailTimes):
            task.run = _raiser(fault.error())
        try:
            self._tracer(task)(d.token.task_id, args, kwargs, request)
        finally:
            if isinstance(fault, FailTimes):
                if patched:
                    task.run = saved
                else:
                    del task.run
        record("failed" if isinstance(fault, FailTimes) else "ran")

    def _tracer(self, task: Any) -> Any:
        tracer = self._tracers.get(id(task))
        if tracer is None:
            from celery.app.trace import build_tracer

            tracer = build_tracer(task.name, task, app=task.app, eager=True, store_errors=False, hostname=WORKER)
            self._tracers[id(task)] = tracer
        return tracer

    def close(self) -> None:
        """Give the apps back the orchestrators they had before this kit, and the process
        its heartbeater."""
        from ..runtime.heartbeat import install_heartbeater

        install_heartbeater(self._heartbeater_was)
        for ident, previous in self._installed.items():
            if previous is None:
                process._orchestrators.pop(ident, None)
            else:
                process._orchestrators[ident] = previous
        self._installed.clear()


def _raiser(error: BaseException) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise error

    return run


def roundtrip(app: Any, d: Dispatch) -> tuple[list[Any], dict[str, Any]]:
    """The message's arguments as a worker reads them: through the app's serializer and back."""
    from kombu import serialization

    serializer = app.conf.task_serializer or "json"
    body = (list(d.args), dict(d.kwargs), {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    content_type, encoding, data = serialization.dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    args, kwargs, _ = serialization.loads(data, content_type, encoding, accept=[content_type])  # type: ignore[no-untyped-call]
    return list(args), dict(kwargs)


def message_request(key: bytes, d: Dispatch, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request a worker makes of the message the publisher would send for ``d``: its
    fencing headers (signed with the deployment's key) among the request's fields."""
    direct = bool(getattr(d, "direct", False))
    signature = protocol.sign(key, d.task_name, d.token, (d.args, d.kwargs) if direct else None)
    extra: dict[str, Any] = {"direct": True} if direct else {}
    options = protocol.send_options(
        d.token,
        queue=d.queue,
        soft_time_limit=d.soft_time_limit,
        time_limit=d.time_limit,
        signature=signature,
        **extra,
    )
    headers: dict[str, Any] = options["headers"]
    return {
        **headers,
        "id": d.token.task_id,
        "task": d.task_name,
        "hostname": WORKER,
        "headers": headers,
        "delivery_info": {"exchange": "", "routing_key": d.queue, "priority": None, "redelivered": False},
        "timelimit": (d.time_limit, d.soft_time_limit),
        "args": args,
        "kwargs": kwargs,
    }


# ---------------------------------------------------------------------------------- the test's kit

_current: Kit | None = None
#: how the plugin makes a test's kit on first use (``request.getfixturevalue("orchestrator")``)
_lazy: Callable[[], Kit] | None = None


def current_kit() -> Kit:
    """The running test's kit (the ``orchestrator`` fixture's)."""
    if _current is None and _lazy is not None:
        _lazy()
    if _current is None:
        raise KitError(
            "no test kit: run under pytest with the orchestrator plugin (installed with the package), or"
            " pass kit=Kit(KitDatabase.prepare(url))"
        )
    return _current


def set_current(kit: Kit | None) -> None:
    global _current
    _current = kit


def set_lazy(make: Callable[[], Kit] | None) -> None:
    global _lazy
    _lazy = make


def run_dag(
    dag: DAG,
    *,
    clock: Clock | dt.datetime | None = None,
    faults: Mapping[str, Fault | Sequence[Fault]] | None = None,
    events: Iterable[Input] = (),
    auto_advance: bool = True,
    tasks: Mapping[str, Any] | None = None,
    kit: Kit | None = None,
    **submit: Any,
) -> RunResult:
    """Run ``dag`` in this process through the production transitions and return what it came to.

    Its tasks' bodies are the real Celery tasks its nodes name (``tasks={name: task or
    function}`` stands one in), run one message at a time by an in-process worker through the
    worker's own code; the broker is an in-process queue and the reconciler runs between
    messages. ``faults={node key, map key or task name: FailTimes(2, exc=TimeoutError) |
    LoseDispatch() | CrashWorker()}`` injects failures; ``events=[emit(...), signal(...),
    approve(...), reject(...)]`` are delivered once something waits for them (or ``after``
    seconds of virtual time). With ``auto_advance`` the test's virtual clock (``clock``: a
    datetime starts the run at that instant) jumps to each instant the run waits for. The
    other keywords are :meth:`Orchestrator.submit`'s (``idempotency_key``, ``logical_date``...).
    """
    return (kit or current_kit()).run_dag(
        dag, clock=clock, faults=faults, events=events, auto_advance=auto_advance, tasks=tasks, **submit
    )
