"""Persistence core: plumbing, compare-and-set primitives, settlement and admission.

The store is three layers: this core, ``store_recovery`` (reconciler, operator and
worker-registry operations) and ``store`` (submit, the worker side and reads, the facade).
The contract of all three: every task state change is one compare-and-set ``UPDATE ... WHERE state =
:expected AND attempt = :attempt`` with its event row in the same transaction; a CAS
that loses its race writes a *rejected* event instead (the conflict ledger) and the
method reports the loss to its caller. Times come from the database (``db_now``).
Rows become domain objects (``models.py``) here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from . import schema as s
from .backoff import Backoff, Jitter
from .dbtime import aware, db_after, db_now, register_sqlite_functions
from .errors import SchemaMissingError
from .models import Dispatch, RunView, TaskView
from .states import (
    TERMINAL,
    RunState,
    TaskState,
    TriggerRule,
    UpstreamCounts,
    check_transition,
    decide,
    run_outcome,
)

log = logging.getLogger(__name__)
#: advisory lock key serializing admission on Postgres (any constant unlikely to clash)
ADMISSION_LOCK = 0x6F7263_01
T = TaskState
R = TypeVar("R")

t_tasks, t_runs, t_edges, t_events = s.tasks, s.runs, s.edges, s.events
t_workers, t_effects = s.workers, s.effects


def make_engine(url: str) -> Engine:
    """An engine for ``url``: psycopg 3 pool with pre-ping on Postgres, WAL SQLite otherwise."""
    if url.startswith("sqlite"):
        path = sa.engine.make_url(url).database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False}, pool_pre_ping=False)

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            register_sqlite_functions(dbapi_conn)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # one writer at a time, taken up front: no lock upgrades, no SQLITE_BUSY deadlocks
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Outcome:
    """What a worker's completion CAS did."""

    accepted: bool
    state: TaskState | None
    dispatches: list[Dispatch]


class StoreCore:
    """Plumbing and the primitives every state change is built from."""

    def __init__(
        self,
        url_or_engine: str | Engine,
        *,
        id_factory: Callable[[], str] = new_run_id,
        poison_threshold: int = 2,
        crash_loop_threshold: int = 2,
        worker_ttl: float = 30.0,
    ) -> None:
        self.engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        self.poison_threshold = poison_threshold
        self.crash_loop_threshold = crash_loop_threshold
        self.worker_ttl = worker_ttl
        self.is_postgres = self.engine.dialect.name == "postgresql"
        self.new_id = id_factory

    # ------------------------------------------------------------------ plumbing

    def transaction(self, fn: Callable[[Connection], R], *, attempts: int = 5) -> R:
        """Run ``fn`` in one transaction, retried on deadlock, serialization failure or a
        dropped connection. ``fn`` must be safe to re-run: every write in it is a CAS."""
        for i in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return fn(conn)
            except sa.exc.DBAPIError as exc:
                if i + 1 >= attempts or not _retryable(exc):
                    raise
                log.warning("retrying transaction after %s", type(exc.orig).__name__)
                time.sleep(0.01 * (2**i) * (1 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def create_schema(self) -> None:
        """Create the tables directly (tests, embedded default); production uses Alembic."""
        s.metadata.create_all(self.engine)

    def check_schema(self) -> None:
        """Raise :class:`SchemaMissingError` when the tables do not exist."""
        if not sa.inspect(self.engine).has_table(t_runs.name):
            raise SchemaMissingError(
                f"the database {self.engine.url.render_as_string(hide_password=True)} has no"
                " orchestrator schema: run `orchestrator db upgrade`"
            )

    def dispose(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ dispatch

    def admit(self, conn: Connection, window: int) -> list[Dispatch]:
        """CAS READY -> QUEUED for as many tasks as live workers can take, in priority order;
        returns the messages to publish *after* the caller commits.

        The in-flight window of a group of workers consuming the same queues is the sum of
        their concurrency: every published message has a free slot waiting for it, so a
        QUEUED task that stays unclaimed past the dispatch timeout was really lost. At most
        ``window`` tasks are QUEUED or RUNNING in all.
        """
        ready = conn.execute(sa.select(t_tasks.c.run_id).where(t_tasks.c.state == T.READY.value).limit(1)).first()
        if ready is None:
            return []
        groups = self._capacity(conn)
        if not groups:
            return []
        if self.is_postgres:
            # Count and admit as one step: two dispatchers counting at once would overshoot the
            # capacity. Not waiting: the holder is admitting right now, and a slot it could not
            # see yet is filled by the next completion or tick.
            if not conn.execute(sa.select(sa.func.pg_try_advisory_xact_lock(ADMISSION_LOCK))).scalar_one():
                return []
        inflight: dict[str, int] = {
            q: n
            for q, n in conn.execute(
                sa.select(t_tasks.c.queue, sa.func.count())
                .where(t_tasks.c.state.in_([T.QUEUED.value, T.RUNNING.value]))
                .group_by(t_tasks.c.queue)
            ).all()
        }
        total = sum(inflight.values())
        check_transition(T.READY, T.QUEUED, "dispatcher")
        rows: list[Any] = []
        for queues, capacity in groups.items():
            room = min(capacity - sum(inflight.get(q, 0) for q in queues), window - total)
            if room <= 0:
                continue
            picked = (
                sa.select(t_tasks.c.run_id, t_tasks.c.key)
                .where(t_tasks.c.state == T.READY.value, t_tasks.c.queue.in_(sorted(queues)))
                .order_by(t_tasks.c.priority_rank, t_tasks.c.ready_at)
                .limit(room)
                .with_for_update(skip_locked=True)
                # a CTE is evaluated once; an IN (subquery) may be re-run per row and over-admit
                .cte("picked")
            )
            admitted = conn.execute(
                t_tasks.update()
                .where(
                    t_tasks.c.run_id == picked.c.run_id,
                    t_tasks.c.key == picked.c.key,
                    t_tasks.c.state == T.READY.value,
                )
                .values(state=T.QUEUED.value, dispatched_at=db_now())
                .returning(*_DISPATCH_COLUMNS)
            ).all()
            for r in admitted:
                inflight[r.queue] = inflight.get(r.queue, 0) + 1
            total += len(admitted)
            rows.extend(admitted)
        if not rows:
            return []
        # RETURNING has no order: publish in the order the rows were picked
        rows.sort(key=lambda r: (r.priority_rank, r.ready_at))
        conn.execute(
            _EVENTS_AT_DB_NOW,
            [_event(r.run_id, r.key, r.attempt, T.READY, T.QUEUED, "dispatcher", None, True) for r in rows],
        )
        return [_dispatch(r) for r in rows]

    def _capacity(self, conn: Connection) -> dict[frozenset[str], int]:
        """Live workers' concurrency summed per set of consumed queues."""
        groups: dict[frozenset[str], int] = {}
        rows = conn.execute(
            sa.select(t_workers.c.queues, t_workers.c.concurrency).where(
                t_workers.c.seen_at > db_after(-self.worker_ttl)
            )
        ).all()
        for queues, concurrency in rows:
            key = frozenset(queues)
            groups[key] = groups.get(key, 0) + int(concurrency)
        return groups

    def admit_ready(self, window: int) -> list[Dispatch]:
        return self.transaction(lambda conn: self.admit(conn, window))

    def release_due_retries(self, window: int) -> tuple[int, list[Dispatch]]:
        """CAS RETRYING -> READY for retries whose ``not_before`` has passed, then admit."""

        def tx(conn: Connection) -> tuple[int, list[Dispatch]]:
            check_transition(T.RETRYING, T.READY, "reconciler")
            rows = conn.execute(
                t_tasks.update()
                .where(t_tasks.c.state == T.RETRYING.value, t_tasks.c.not_before <= db_now())
                .values(state=T.READY.value, ready_at=db_now())
                .returning(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt)
            ).all()
            if rows:
                conn.execute(
                    _EVENTS_AT_DB_NOW,
                    [
                        _event(r.run_id, r.key, r.attempt, T.RETRYING, T.READY, "reconciler", "retry due", True)
                        for r in rows
                    ],
                )
            return len(rows), self.admit(conn, window)

        return self.transaction(tx)

    def _finish_attempt(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        state: TaskState,
        actor: str,
        error: str,
        values: dict[str, Any],
        backoff: dict[str, Any],
        window: int,
    ) -> Outcome:
        values = {**values, "lease_expires_at": None}
        reason = error
        if state is T.RETRYING:
            delay = _backoff(backoff).delay(attempt)
            reason = f"{error} (retry in {delay:.2f}s)"
            values.update(attempt=attempt + 1, not_before=db_after(delay))
        elif state is T.DEAD_LETTER:
            reason = f"dead letter: {error}"
        else:
            values["finished_at"] = db_now()
        moved = self._cas(conn, run_id, key, attempt, T.RUNNING, state, actor, reason, values)
        if moved is None:
            return Outcome(False, None, [])
        if state is T.FAILED:
            self._settle(conn, run_id, [(key, T.FAILED, moved.children or [])])
            return Outcome(True, state, self.admit(conn, window))
        return Outcome(True, state, self.admit(conn, window))

    # ------------------------------------------------------------------ internals

    def _cas(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        src: TaskState,
        dst: TaskState,
        actor: str,
        reason: str | None,
        values: dict[str, Any],
        returning: tuple[Any, ...] = (t_tasks.c.children,),
    ) -> Any:
        """The compare-and-set of one task ``src`` -> ``dst`` for ``attempt``, with its event.

        Returns the moved row's ``returning`` columns (default: its child keys), or ``None``
        with a rejected event when the row did not hold ``src`` and ``attempt``. On Postgres
        the UPDATE and the event INSERT are one statement (a data-modifying CTE).
        """
        check_transition(src, dst, actor)
        moved = (
            t_tasks.update()
            .where(*holds(run_id, key, src, attempt))
            .values(state=dst.value, **values)
            .returning(*returning)
        )
        if self.is_postgres:
            cte = moved.cte("moved")
            event = t_events.insert().from_select(
                _EVENT_COLUMNS,
                sa.select(
                    sa.literal(run_id, sa.String), sa.literal(key, sa.String), sa.literal(attempt, sa.Integer),
                    sa.literal(src.value, sa.String), sa.literal(dst.value, sa.String),
                    sa.literal(actor, sa.String), sa.literal(reason, sa.Text), sa.true(), db_now(),
                ).select_from(cte),
            )  # fmt: skip
            row = conn.execute(sa.select(*(cte.c[c.name] for c in returning)).add_cte(event.cte("event"))).first()
        else:
            row = conn.execute(moved).first()
            if row is not None:
                self._record(conn, run_id, key, attempt, src, dst, actor, reason)
        if row is None:
            self._reject(conn, run_id, key, attempt, dst, actor, reason)
        return row

    def _record(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        src: TaskState | None,
        dst: TaskState,
        actor: str,
        reason: str | None,
    ) -> None:
        conn.execute(_EVENTS_AT_DB_NOW, _event(run_id, key, attempt, src, dst, actor, reason, True))

    def _reject(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        dst: TaskState,
        actor: str,
        reason: str | None,
    ) -> None:
        """Write the rejected event of a CAS that lost, naming what the row holds now."""
        row = conn.execute(
            sa.select(t_tasks.c.state, t_tasks.c.attempt).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
        ).first()
        now_holds = "no such task" if row is None else f"row holds {row.state} attempt {row.attempt}"
        text = f"{reason + '; ' if reason else ''}{now_holds}"
        log.info("rejected %s %s.%s attempt %s -> %s: %s", actor, run_id, key, attempt, dst.value, text)
        src = TaskState(row.state) if row else None
        conn.execute(_EVENTS_AT_DB_NOW, _event(run_id, key, attempt, src, dst, actor, text, False))

    def _settle(self, conn: Connection, run_id: str, finished: list[tuple[str, TaskState, list[str]]]) -> None:
        """Count the newly terminal tasks (key, state, child keys) into their children's
        counters, decide trigger rules, cascade SKIPPED / UPSTREAM_FAILED, and close the run
        when nothing is open."""
        closed = len(finished)
        work = list(finished)
        while work:
            key, state, children = work.pop()
            rows = self._count_into_children(conn, run_id, children, state)
            decided: dict[TaskState, list[tuple[str, int]]] = {}
            for r in rows:
                if r.state != T.PENDING.value:
                    continue
                counts = UpstreamCounts(r.n_upstream, r.n_done, r.n_succeeded, r.n_failed, r.n_skipped)
                verdict = decide(TriggerRule(r.trigger_rule), counts)
                if verdict is not None:
                    decided.setdefault(verdict, []).append((r.key, r.attempt))
            for verdict, keys in decided.items():
                moved = self._cas_many(
                    conn, run_id, keys, T.PENDING, verdict, "worker", f"upstream {key} {state.value}"
                )
                if verdict in TERMINAL:
                    closed += len(moved)
                    work.extend((k, verdict, grandchildren) for k, grandchildren in moved)
        self._close_tasks(conn, run_id, closed)

    def _count_into_children(self, conn: Connection, run_id: str, children: list[str], state: TaskState) -> list[Any]:
        """Add a terminal parent to its children's counters; return the children's new rows.

        The child keys come from the parent's row and are matched on the tasks' full primary
        key (a VALUES join on Postgres): a join through ``orc_edges`` is planned as a scan of
        the whole run when the run is newer than the table statistics, hundreds of
        milliseconds for a 2,000-task run.
        """
        if not children:
            return []
        stmt = t_tasks.update().values(
            n_done=t_tasks.c.n_done + 1,
            n_succeeded=t_tasks.c.n_succeeded + int(state is T.SUCCEEDED),
            n_failed=t_tasks.c.n_failed + int(state in (T.FAILED, T.UPSTREAM_FAILED)),
            n_skipped=t_tasks.c.n_skipped + int(state is T.SKIPPED),
        )
        if self.is_postgres and len(children) > 1:
            keys = sa.values(sa.column("child", sa.String), name="children").data([(c,) for c in children])
            stmt = stmt.where(t_tasks.c.run_id == run_id, t_tasks.c.key == keys.c.child)
        elif len(children) == 1:
            stmt = stmt.where(t_tasks.c.run_id == run_id, t_tasks.c.key == children[0])
        else:
            stmt = stmt.where(t_tasks.c.run_id == run_id, t_tasks.c.key.in_(children))
        return list(conn.execute(stmt.returning(*_COUNTER_COLUMNS)).all())

    def _cas_many(
        self,
        conn: Connection,
        run_id: str,
        keys: Sequence[tuple[str, int]],
        src: TaskState,
        dst: TaskState,
        actor: str,
        reason: str,
    ) -> list[tuple[str, list[str]]]:
        """CAS many tasks of a run ``src`` -> ``dst``; returns (key, child keys) of those moved."""
        check_transition(src, dst, actor)
        extra: dict[str, Any] = {"ready_at": db_now()} if dst is T.READY else {"finished_at": db_now()}
        moved = conn.execute(
            t_tasks.update()
            .where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.key.in_([k for k, _ in keys]),
                t_tasks.c.state == src.value,
            )
            .values(state=dst.value, **extra)
            .returning(t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.children)
        ).all()
        if moved:
            conn.execute(
                _EVENTS_AT_DB_NOW,
                [_event(run_id, m.key, m.attempt, src, dst, actor, reason, True) for m in moved],
            )
        lost = {k for k, _ in keys} - {m.key for m in moved}
        for k, a in keys:
            if k in lost:
                self._reject(conn, run_id, k, a, dst, actor, reason)
        return [(m.key, list(m.children or [])) for m in moved]

    def _close_tasks(self, conn: Connection, run_id: str, closed: int, *, recount: bool = False) -> None:
        if recount:
            count = (
                sa.select(sa.func.count())
                .where(t_tasks.c.run_id == run_id, t_tasks.c.state.not_in([s.value for s in TERMINAL]))
                .scalar_subquery()
            )
            new_value: Any = count
        else:
            new_value = t_runs.c.open_tasks - closed
        left = conn.execute(
            t_runs.update().where(t_runs.c.id == run_id).values(open_tasks=new_value).returning(t_runs.c.open_tasks)
        ).scalar_one()
        if left > 0:
            return
        failed = conn.execute(
            sa.select(sa.func.count()).where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.state.in_([T.FAILED.value, T.UPSTREAM_FAILED.value]),
            )
        ).scalar_one()
        conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id, t_runs.c.state == RunState.RUNNING.value)
            .values(state=run_outcome(failed).value, finished_at=db_now())
        )


def holds(run_id: str, key: str, state: TaskState, attempt: int) -> tuple[Any, ...]:
    """The fence of every compare-and-set: the row still holds ``state`` for ``attempt``."""
    return (
        t_tasks.c.run_id == run_id,
        t_tasks.c.key == key,
        t_tasks.c.state == state.value,
        t_tasks.c.attempt == attempt,
    )


def _event(
    run_id: str,
    key: str,
    attempt: int,
    src: TaskState | None,
    dst: TaskState,
    actor: str,
    reason: str | None,
    accepted: bool,
) -> dict[str, Any]:
    """One event row's parameters for :data:`_EVENTS_AT_DB_NOW` (its time is the database's)."""
    return {
        "run_id": run_id,
        "key": key,
        "attempt": attempt,
        "from_state": src.value if src else None,
        "to_state": dst.value,
        "actor": actor,
        "reason": reason,
        "accepted": accepted,
    }


#: bulk insert of event rows stamped with the database's clock, without a round trip for it
_EVENTS_AT_DB_NOW = t_events.insert().values(at=db_now())


_COUNTER_COLUMNS = (
    t_tasks.c.key,
    t_tasks.c.state,
    t_tasks.c.attempt,
    t_tasks.c.trigger_rule,
    t_tasks.c.n_upstream,
    t_tasks.c.n_done,
    t_tasks.c.n_succeeded,
    t_tasks.c.n_failed,
    t_tasks.c.n_skipped,
)

_EVENT_COLUMNS = ["run_id", "key", "attempt", "from_state", "to_state", "actor", "reason", "accepted", "at"]

_DISPATCH_COLUMNS = (
    t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.task_name, t_tasks.c.args, t_tasks.c.kwargs,
    t_tasks.c.queue, t_tasks.c.soft_time_limit, t_tasks.c.time_limit, t_tasks.c.priority_rank, t_tasks.c.ready_at,
)  # fmt: skip


def _dispatch(r: Any) -> Dispatch:
    return Dispatch(
        r.run_id, r.key, r.attempt, r.task_name, list(r.args), dict(r.kwargs), r.queue, r.soft_time_limit, r.time_limit
    )


def _backoff(raw: dict[str, Any]) -> Backoff:
    return Backoff(base=raw["base"], cap=raw["cap"], jitter=Jitter(raw["jitter"]))


def _run_view(row: Any, counts: dict[str, int]) -> RunView:
    return RunView(
        id=row.id,
        dag=row.dag_name,
        tenant=row.tenant,
        state=RunState(row.state),
        priority=row.priority,
        idempotency_key=row.idempotency_key,
        params=row.params,
        task_count=row.task_count,
        open_tasks=row.open_tasks,
        created_at=aware(row.created_at),
        finished_at=aware(row.finished_at),
        counts=counts,
    )


def _task_view(r: Any) -> TaskView:
    return TaskView(
        run_id=r.run_id,
        key=r.key,
        task=r.task_name,
        state=TaskState(r.state),
        attempt=r.attempt,
        max_attempts=r.max_attempts,
        trigger_rule=r.trigger_rule,
        queue=r.queue,
        priority=r.priority,
        args=r.args,
        kwargs=r.kwargs,
        result=r.result,
        error=r.error,
        fingerprint=r.fingerprint,
        worker=r.worker,
        dispatched_at=aware(r.dispatched_at),
        started_at=aware(r.started_at),
        finished_at=aware(r.finished_at),
        not_before=aware(r.not_before),
    )


def _retryable(exc: sa.exc.DBAPIError) -> bool:
    if exc.connection_invalidated:
        return True
    code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if code in {"40P01", "40001", "57P01", "08006", "08003", "08000"}:
        return True
    return "database is locked" in str(exc.orig)
