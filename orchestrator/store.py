"""Persistence: every read and write of the orchestrator's tables.

Contract: every task state change is one compare-and-set ``UPDATE ... WHERE state =
:expected AND attempt = :attempt`` with its event row in the same transaction; a CAS
that loses its race writes a *rejected* event instead (the conflict ledger) and the
method reports the loss to its caller. Times come from the database (``db_now``).
Rows become domain objects (``models.py``) here and nowhere else.
"""

from __future__ import annotations

import functools
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
from .dag import DAG
from .dbtime import aware, db_after, db_now, register_sqlite_functions
from .errors import OperatorError, RunNotFound, SchemaMissingError, TaskNotFound
from .models import Claim, Dispatch, EventView, RunView, TaskView, task_id
from .poison import is_retryable, verdict
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


class Store:
    """The persistence facade over one database (Postgres or SQLite)."""

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

    # ------------------------------------------------------------------ submit

    def create_run(
        self,
        dag: DAG,
        *,
        queues: dict[str, str],
        wants_upstream: Callable[[str], bool],
        idempotency_key: str | None = None,
        logical_date: str | None = None,
    ) -> tuple[str, bool]:
        """Insert the run, its tasks, edges and root events in one transaction.

        Returns ``(run_id, created)``; with an ``idempotency_key`` already used for this DAG
        name and tenant, the existing run id and ``False``. ``queues`` maps node key to queue.
        """

        def existing(conn: Connection) -> str | None:
            if idempotency_key is None:
                return None
            return conn.execute(
                sa.select(t_runs.c.id).where(
                    t_runs.c.dag_name == dag.name,
                    t_runs.c.tenant == dag.tenant,
                    t_runs.c.idempotency_key == idempotency_key,
                )
            ).scalar_one_or_none()

        def insert(conn: Connection) -> tuple[str, bool]:
            found = existing(conn)
            if found:
                return found, False
            run_id = self.new_id()
            now = conn.execute(sa.select(db_now())).scalar_one()
            conn.execute(
                t_runs.insert().values(
                    id=run_id,
                    dag_name=dag.name,
                    tenant=dag.tenant,
                    state=RunState.RUNNING.value,
                    priority=dag.priority.value,
                    idempotency_key=idempotency_key,
                    logical_date=logical_date,
                    params=dag.params,
                    dag_snapshot=dag.to_spec(),
                    task_count=len(dag.nodes),
                    open_tasks=len(dag.nodes),
                    created_at=now,
                )
            )
            rows: list[dict[str, Any]] = []
            edge_rows: list[dict[str, str]] = []
            event_rows: list[dict[str, Any]] = []
            for node in dag.nodes.values():
                prio = dag.priority_of(node)
                root = not node.upstream
                rows.append(
                    {
                        "run_id": run_id,
                        "key": node.key,
                        "task_name": node.task,
                        "args": list(node.args),
                        "kwargs": dict(node.kwargs),
                        "state": (T.READY if root else T.PENDING).value,
                        "attempt": 1,
                        "max_attempts": node.max_attempts,
                        "backoff": {
                            "base": node.backoff.base,
                            "cap": node.backoff.cap,
                            "jitter": node.backoff.jitter.value,
                        },
                        "trigger_rule": node.trigger_rule.value,
                        "n_upstream": len(node.upstream),
                        "n_done": 0,
                        "n_succeeded": 0,
                        "n_failed": 0,
                        "n_skipped": 0,
                        "wants_upstream": wants_upstream(node.task),
                        "queue": queues[node.key],
                        "priority": prio.value,
                        "priority_rank": prio.rank,
                        "tenant": dag.tenant,
                        "soft_time_limit": node.soft_time_limit,
                        "time_limit": node.time_limit,
                        "ready_at": now if root else None,
                        "retry_on": list(node.retry_on) or None,
                        "no_retry_on": list(node.no_retry_on) or None,
                    }
                )
                edge_rows.extend({"run_id": run_id, "parent_key": p, "child_key": node.key} for p in node.upstream)
                if root:
                    event_rows.append(_event(run_id, node.key, 1, T.PENDING, T.READY, "submit", "root", True, now))
            conn.execute(t_tasks.insert(), rows)
            if edge_rows:
                conn.execute(t_edges.insert(), edge_rows)
            conn.execute(t_events.insert(), event_rows)
            return run_id, True

        try:
            return self.transaction(insert)
        except sa.exc.IntegrityError:
            # a concurrent submit with the same idempotency key won the unique constraint
            with self.engine.begin() as conn:
                found = existing(conn)
            if found is None:
                raise
            return found, False

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
        now = conn.execute(sa.select(db_now())).scalar_one()
        conn.execute(
            t_events.insert(),
            [_event(r.run_id, r.key, r.attempt, T.READY, T.QUEUED, "dispatcher", None, True, now) for r in rows],
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
                now = conn.execute(sa.select(db_now())).scalar_one()
                conn.execute(
                    t_events.insert(),
                    [
                        _event(r.run_id, r.key, r.attempt, T.RETRYING, T.READY, "reconciler", "retry due", True, now)
                        for r in rows
                    ],
                )
            return len(rows), self.admit(conn, window)

        return self.transaction(tx)

    # ------------------------------------------------------------------ worker side

    def claim(self, run_id: str, key: str, attempt: int, worker: str, lease_seconds: float) -> Claim | None:
        """CAS QUEUED -> RUNNING for ``attempt`` and set the lease.

        Returns ``None`` when the claim lost (unknown run or task, stale attempt, already
        claimed): a rejected event is recorded and the caller must not run the body.
        """

        def tx(conn: Connection) -> Claim | None:
            check_transition(T.QUEUED, T.RUNNING, "worker")
            row = conn.execute(
                t_tasks.update()
                .where(
                    t_tasks.c.run_id == run_id,
                    t_tasks.c.key == key,
                    t_tasks.c.state == T.QUEUED.value,
                    t_tasks.c.attempt == attempt,
                )
                .values(
                    state=T.RUNNING.value,
                    started_at=db_now(),
                    heartbeat_at=db_now(),
                    lease_expires_at=db_after(lease_seconds),
                    worker=worker,
                )
                .returning(t_tasks.c.args, t_tasks.c.kwargs, t_tasks.c.wants_upstream)
            ).first()
            if row is None:
                self._reject(conn, run_id, key, attempt, T.RUNNING, "worker", f"claim refused ({worker})")
                return None
            self._record(conn, run_id, key, attempt, T.QUEUED, T.RUNNING, "worker", worker)
            upstream: dict[str, Any] = {}
            if row.wants_upstream:
                upstream = dict(
                    conn.execute(
                        sa.select(t_tasks.c.key, t_tasks.c.result)
                        .join(
                            t_edges,
                            sa.and_(
                                t_edges.c.run_id == t_tasks.c.run_id,
                                t_edges.c.parent_key == t_tasks.c.key,
                            ),
                        )
                        .where(
                            t_edges.c.run_id == run_id,
                            t_edges.c.child_key == key,
                            t_tasks.c.state == T.SUCCEEDED.value,
                        )
                    ).all()
                )
            return Claim(run_id, key, attempt, list(row.args), dict(row.kwargs), upstream)

        return self.transaction(tx)

    def heartbeat(self, run_id: str, key: str, attempt: int, lease_seconds: float) -> bool:
        """Extend the lease while the row still holds ``attempt`` in RUNNING; ``False`` if not."""
        with self.engine.begin() as conn:
            res = conn.execute(
                t_tasks.update()
                .where(
                    t_tasks.c.run_id == run_id,
                    t_tasks.c.key == key,
                    t_tasks.c.state == T.RUNNING.value,
                    t_tasks.c.attempt == attempt,
                )
                .values(heartbeat_at=db_now(), lease_expires_at=db_after(lease_seconds))
            )
            return res.rowcount == 1

    def succeed(self, run_id: str, key: str, attempt: int, result: Any, window: int) -> Outcome:
        """CAS RUNNING -> SUCCEEDED with ``result``, settle the children, admit ready tasks."""

        def tx(conn: Connection) -> Outcome:
            ok = self._cas(
                conn,
                run_id,
                key,
                attempt,
                T.RUNNING,
                T.SUCCEEDED,
                "worker",
                None,
                {"result": result, "finished_at": db_now(), "lease_expires_at": None},
            )
            if not ok:
                return Outcome(False, None, [])
            self._settle(conn, run_id, [(key, T.SUCCEEDED)])
            return Outcome(True, T.SUCCEEDED, self.admit(conn, window))

        return self.transaction(tx)

    def fail(
        self,
        run_id: str,
        key: str,
        attempt: int,
        *,
        error: str,
        window: int,
        exc_types: Sequence[str] = (),
        fingerprint: str | None = None,
        retryable: bool = True,
        actor: str = "worker",
    ) -> Outcome:
        """Record a failed attempt, fenced by ``attempt``.

        The verdict (:func:`orchestrator.poison.verdict`): DEAD_LETTER when the same
        ``fingerprint`` failed ``poison_threshold`` attempts in a row (parked, no cascade,
        alert); RETRYING with ``attempt + 1`` and ``not_before`` = now + backoff while the
        failure is retryable (``retry_on`` / ``no_retry_on`` over ``exc_types``) and attempts
        remain; FAILED otherwise, with its consequences downstream. A stale attempt loses
        (``accepted=False``) and a rejected event is written.
        """

        def tx(conn: Connection) -> Outcome:
            row = conn.execute(
                sa.select(
                    t_tasks.c.max_attempts, t_tasks.c.backoff, t_tasks.c.fingerprint,
                    t_tasks.c.fingerprint_streak, t_tasks.c.retry_on, t_tasks.c.no_retry_on,
                ).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
            ).first()  # fmt: skip
            if row is None:
                self._reject(conn, run_id, key, attempt, T.FAILED, actor, error)
                return Outcome(False, None, [])
            streak = row.fingerprint_streak + 1 if fingerprint and fingerprint == row.fingerprint else 1
            retry = retryable and is_retryable(exc_types, row.retry_on, row.no_retry_on)
            state = verdict(
                attempt=attempt,
                max_attempts=row.max_attempts,
                retryable=retry,
                streak=streak if fingerprint else 0,
                threshold=self.poison_threshold,
            )
            common = {"error": error, "fingerprint": fingerprint, "fingerprint_streak": streak, "lease_losses": 0}
            return self._finish_attempt(conn, run_id, key, attempt, state, actor, error, common, row.backoff, window)

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
        if not self._cas(conn, run_id, key, attempt, T.RUNNING, state, actor, reason, values):
            return Outcome(False, None, [])
        if state is T.FAILED:
            self._settle(conn, run_id, [(key, T.FAILED)])
            return Outcome(True, state, self.admit(conn, window))
        return Outcome(True, state, self.admit(conn, window))

    # ------------------------------------------------------------------ reconciler

    def stale_queued(self, dispatch_timeout: float, limit: int = 500) -> list[tuple[str, str, int, Any]]:
        """QUEUED tasks unclaimed for longer than ``dispatch_timeout``: (run, key, attempt, dispatched_at)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.dispatched_at)
                .where(t_tasks.c.state == T.QUEUED.value, t_tasks.c.dispatched_at < db_after(-dispatch_timeout))
                .limit(limit)
            ).all()
        return [(r.run_id, r.key, r.attempt, r.dispatched_at) for r in rows]

    def redispatch(self, run_id: str, key: str, attempt: int, dispatched_at: Any) -> Dispatch | None:
        """CAS QUEUED -> QUEUED (same attempt, new ``dispatched_at``) for one stale task.

        ``dispatched_at`` is the version read by :meth:`stale_queued`: of two reconcilers
        that saw the same stale row, one re-publishes and the other loses (rejected event).
        """

        def tx(conn: Connection) -> Dispatch | None:
            check_transition(T.QUEUED, T.QUEUED, "reconciler")
            row = conn.execute(
                t_tasks.update()
                .where(
                    t_tasks.c.run_id == run_id,
                    t_tasks.c.key == key,
                    t_tasks.c.state == T.QUEUED.value,
                    t_tasks.c.attempt == attempt,
                    t_tasks.c.dispatched_at == dispatched_at,
                )
                .values(dispatched_at=db_now())
                .returning(*_DISPATCH_COLUMNS)
            ).first()
            reason = "unclaimed past the dispatch timeout: re-published"
            if row is None:
                self._reject(conn, run_id, key, attempt, T.QUEUED, "reconciler", reason)
                return None
            self._record(conn, run_id, key, attempt, T.QUEUED, T.QUEUED, "reconciler", reason)
            return _dispatch(row)

        return self.transaction(tx)

    def expired_leases(self, lease_seconds: float, limit: int = 500) -> list[tuple[str, str, int]]:
        """RUNNING tasks silent for longer than a lease, measured from the last sign of life
        (``COALESCE(heartbeat, started, dispatched)``) so a task that died before its first
        heartbeat is caught too."""
        last_seen = sa.func.coalesce(t_tasks.c.heartbeat_at, t_tasks.c.started_at, t_tasks.c.dispatched_at)
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt)
                .where(t_tasks.c.state == T.RUNNING.value, last_seen < db_after(-lease_seconds))
                .limit(limit)
            ).all()
        return [(r.run_id, r.key, r.attempt) for r in rows]

    def lose_lease(self, run_id: str, key: str, attempt: int, lease_seconds: float, window: int) -> Outcome:
        """Fail an attempt whose lease expired: RETRYING with backoff, FAILED when attempts are
        exhausted, DEAD_LETTER after ``crash_loop_threshold`` consecutive lost leases.
        Re-checks the expiry inside the CAS, so a heartbeat that just landed wins."""

        def tx(conn: Connection) -> Outcome:
            last_seen = sa.func.coalesce(t_tasks.c.heartbeat_at, t_tasks.c.started_at, t_tasks.c.dispatched_at)
            row = conn.execute(
                sa.select(t_tasks.c.max_attempts, t_tasks.c.backoff, t_tasks.c.lease_losses, t_tasks.c.worker)
                .where(
                    t_tasks.c.run_id == run_id,
                    t_tasks.c.key == key,
                    t_tasks.c.state == T.RUNNING.value,
                    t_tasks.c.attempt == attempt,
                    last_seen < db_after(-lease_seconds),
                )
                .with_for_update()
            ).first()
            error = "LeaseExpired: no heartbeat for a whole lease (worker killed, paused or lost)"
            if row is None:
                self._reject(conn, run_id, key, attempt, T.RETRYING, "reconciler", error + "; lease is live")
                return Outcome(False, None, [])
            losses = row.lease_losses + 1
            if self.crash_loop_threshold > 0 and losses >= self.crash_loop_threshold:
                state = T.DEAD_LETTER
                error = f"crash loop: lease lost on {losses} consecutive attempts (last on {row.worker})"
            else:
                state = T.RETRYING if attempt < row.max_attempts else T.FAILED
                error = f"{error} on {row.worker}"
            values = {"error": error, "lease_losses": losses, "fingerprint": None, "fingerprint_streak": 0}
            return self._finish_attempt(
                conn, run_id, key, attempt, state, "reconciler", error, values, row.backoff, window
            )

        return self.transaction(tx)

    def finalize_runs(self, limit: int = 100) -> int:
        """Close RUNNING runs whose tasks are all terminal (safety net for the counter)."""
        open_task = (
            sa.select(t_tasks.c.key)
            .where(t_tasks.c.run_id == t_runs.c.id, t_tasks.c.state.not_in([s.value for s in TERMINAL]))
            .exists()
        )
        with self.engine.connect() as conn:
            ids = conn.execute(
                sa.select(t_runs.c.id).where(t_runs.c.state == RunState.RUNNING.value, ~open_task).limit(limit)
            ).scalars().all()  # fmt: skip
        for run_id in ids:
            self.transaction(functools.partial(self._recount, run_id))
        return len(ids)

    def _recount(self, run_id: str, conn: Connection) -> None:
        self._close_tasks(conn, run_id, 0, recount=True)

    # ------------------------------------------------------------------ operator

    def retry_task(self, run_id: str, key: str, window: int) -> Outcome:
        """Operator: DEAD_LETTER or FAILED -> READY with ``attempt + 1``.

        A FAILED task can be retried only while none of its children has been decided; its
        children's counters and the run are reopened. Raises :class:`OperatorError`.
        """

        def tx(conn: Connection) -> Outcome:
            task = self._task_row(conn, run_id, key)
            src = TaskState(task.state)
            if src not in (T.DEAD_LETTER, T.FAILED):
                raise OperatorError(f"task {key!r} is {src.value}: only DEAD_LETTER or FAILED tasks can be retried")
            if src is T.FAILED:
                children = conn.execute(
                    sa.select(t_tasks.c.key, t_tasks.c.state).where(
                        t_tasks.c.run_id == run_id,
                        t_tasks.c.key.in_(
                            sa.select(t_edges.c.child_key).where(
                                t_edges.c.run_id == run_id, t_edges.c.parent_key == key
                            )
                        ),
                    )
                ).all()
                decided = [c.key for c in children if c.state != T.PENDING.value]
                if decided:
                    raise OperatorError(
                        f"task {key!r} has children already decided ({', '.join(decided[:5])}); retry it before"
                        " its downstream is settled, or submit a new run"
                    )
                conn.execute(
                    t_tasks.update()
                    .where(t_tasks.c.run_id == run_id, t_tasks.c.key.in_([c.key for c in children]))
                    .values(n_done=t_tasks.c.n_done - 1, n_failed=t_tasks.c.n_failed - 1)
                )
                conn.execute(
                    t_runs.update()
                    .where(t_runs.c.id == run_id)
                    .values(open_tasks=t_runs.c.open_tasks + 1, state=RunState.RUNNING.value, finished_at=None)
                )
            values = {
                "attempt": task.attempt + 1, "ready_at": db_now(), "finished_at": None, "not_before": None,
                "fingerprint_streak": 0, "lease_losses": 0,
            }  # fmt: skip
            ok = self._cas(conn, run_id, key, task.attempt, src, T.READY, "operator", "manual retry", values)
            return Outcome(ok, T.READY if ok else None, self.admit(conn, window) if ok else [])

        return self.transaction(tx)

    def resolve_dead_letter(self, run_id: str, key: str, to: TaskState, window: int) -> Outcome:
        """Operator: DEAD_LETTER -> FAILED or SKIPPED; descendants follow their trigger rules."""

        def tx(conn: Connection) -> Outcome:
            task = self._task_row(conn, run_id, key)
            if task.state != T.DEAD_LETTER.value:
                raise OperatorError(f"task {key!r} is {task.state}: only a DEAD_LETTER task can be {to.value.lower()}")
            reason = "operator gave up" if to is T.FAILED else "operator skipped it"
            values = {"finished_at": db_now()}
            ok = self._cas(conn, run_id, key, task.attempt, T.DEAD_LETTER, to, "operator", reason, values)
            if not ok:
                return Outcome(False, None, [])
            self._settle(conn, run_id, [(key, to)])
            return Outcome(True, to, self.admit(conn, window))

        return self.transaction(tx)

    def cancel_run(self, run_id: str) -> list[str]:
        """Operator: every non-terminal task -> CANCELLED and the run CANCELLED.

        Returns the Celery task ids of attempts that were QUEUED or RUNNING, to revoke.
        """

        def tx(conn: Connection) -> list[str]:
            run = conn.execute(sa.select(t_runs.c.state).where(t_runs.c.id == run_id).with_for_update()).first()
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            rows = conn.execute(
                sa.select(t_tasks.c.key, t_tasks.c.state, t_tasks.c.attempt)
                .where(t_tasks.c.run_id == run_id, t_tasks.c.state.not_in([s.value for s in TERMINAL]))
                .with_for_update()
            ).all()
            conn.execute(
                t_tasks.update()
                .where(t_tasks.c.run_id == run_id, t_tasks.c.state.not_in([s.value for s in TERMINAL]))
                .values(state=T.CANCELLED.value, finished_at=db_now(), lease_expires_at=None)
            )
            now = conn.execute(sa.select(db_now())).scalar_one()
            if rows:
                conn.execute(
                    t_events.insert(),
                    [
                        _event(run_id, r.key, r.attempt, TaskState(r.state), T.CANCELLED, "operator", "run cancelled",
                               True, now)
                        for r in rows
                    ],
                )  # fmt: skip
            conn.execute(
                t_runs.update()
                .where(t_runs.c.id == run_id)
                .values(state=RunState.CANCELLED.value, open_tasks=0, finished_at=db_now())
            )
            live = (T.QUEUED.value, T.RUNNING.value)
            return [task_id(run_id, r.key, r.attempt) for r in rows if r.state in live]

        return self.transaction(tx)

    def _task_row(self, conn: Connection, run_id: str, key: str) -> Any:
        row = conn.execute(
            sa.select(t_tasks.c.state, t_tasks.c.attempt)
            .where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
            .with_for_update()
        ).first()
        if row is None:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return row

    # ------------------------------------------------------------------ workers and effects

    def register_worker(self, name: str, queues: Sequence[str], concurrency: int) -> None:
        """Insert or refresh a live worker's capacity (its pool size on its queues)."""

        def tx(conn: Connection) -> None:
            conn.execute(t_workers.delete().where(t_workers.c.name == name))
            conn.execute(
                t_workers.insert().values(
                    name=name, queues=sorted(queues), concurrency=concurrency, started_at=db_now(), seen_at=db_now()
                )
            )

        self.transaction(tx)

    def touch_worker(self, name: str) -> bool:
        with self.engine.begin() as conn:
            res = conn.execute(t_workers.update().where(t_workers.c.name == name).values(seen_at=db_now()))
            return res.rowcount == 1

    def unregister_worker(self, name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(t_workers.delete().where(t_workers.c.name == name))

    def record_effect(self, run_id: str, key: str, attempt: int, pid: int) -> None:
        """Note one execution of a probe body (fault tests count duplicates from these rows)."""
        with self.engine.begin() as conn:
            conn.execute(t_effects.insert().values(run_id=run_id, key=key, attempt=attempt, pid=pid, at=db_now()))

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
    ) -> bool:
        check_transition(src, dst, actor)
        res = conn.execute(
            t_tasks.update()
            .where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.key == key,
                t_tasks.c.state == src.value,
                t_tasks.c.attempt == attempt,
            )
            .values(state=dst.value, **values)
        )
        if res.rowcount != 1:
            self._reject(conn, run_id, key, attempt, dst, actor, reason)
            return False
        self._record(conn, run_id, key, attempt, src, dst, actor, reason)
        return True

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
        conn.execute(
            t_events.insert().values(
                run_id=run_id,
                key=key,
                attempt=attempt,
                from_state=src.value if src else None,
                to_state=dst.value,
                actor=actor,
                reason=reason,
                accepted=True,
                at=db_now(),
            )
        )

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
        conn.execute(
            t_events.insert().values(
                run_id=run_id,
                key=key,
                attempt=attempt,
                from_state=row.state if row else None,
                to_state=dst.value,
                actor=actor,
                reason=text,
                accepted=False,
                at=db_now(),
            )
        )

    def _settle(self, conn: Connection, run_id: str, finished: list[tuple[str, TaskState]]) -> None:
        """Count the newly terminal tasks into their children's counters, decide trigger
        rules, cascade SKIPPED / UPSTREAM_FAILED, and close the run when nothing is open."""
        closed = len(finished)
        work = list(finished)
        while work:
            key, state = work.pop()
            rows = conn.execute(
                t_tasks.update()
                .where(
                    t_tasks.c.run_id == run_id,
                    t_tasks.c.key.in_(
                        sa.select(t_edges.c.child_key).where(t_edges.c.run_id == run_id, t_edges.c.parent_key == key)
                    ),
                )
                .values(
                    n_done=t_tasks.c.n_done + 1,
                    n_succeeded=t_tasks.c.n_succeeded + int(state is T.SUCCEEDED),
                    n_failed=t_tasks.c.n_failed + int(state in (T.FAILED, T.UPSTREAM_FAILED)),
                    n_skipped=t_tasks.c.n_skipped + int(state is T.SKIPPED),
                )
                .returning(
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
            ).all()
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
                    work.extend((k, verdict) for k in moved)
        self._close_tasks(conn, run_id, closed)

    def _cas_many(
        self,
        conn: Connection,
        run_id: str,
        keys: Sequence[tuple[str, int]],
        src: TaskState,
        dst: TaskState,
        actor: str,
        reason: str,
    ) -> list[str]:
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
            .returning(t_tasks.c.key, t_tasks.c.attempt)
        ).all()
        now = conn.execute(sa.select(db_now())).scalar_one()
        if moved:
            conn.execute(
                t_events.insert(),
                [_event(run_id, m.key, m.attempt, src, dst, actor, reason, True, now) for m in moved],
            )
        lost = {k for k, _ in keys} - {m.key for m in moved}
        for k, a in keys:
            if k in lost:
                self._reject(conn, run_id, k, a, dst, actor, reason)
        return [m.key for m in moved]

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

    # ------------------------------------------------------------------ reads

    def get_run(self, run_id: str) -> RunView:
        """The run with per-state task counts; raise :class:`RunNotFound`."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t_runs).where(t_runs.c.id == run_id)).first()
            if row is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            counts: dict[str, int] = dict(
                conn.execute(
                    sa.select(t_tasks.c.state, sa.func.count())
                    .where(t_tasks.c.run_id == run_id)
                    .group_by(t_tasks.c.state)
                ).all()
            )
        return _run_view(row, counts)

    def run_state(self, run_id: str) -> RunState:
        with self.engine.connect() as conn:
            state = conn.execute(sa.select(t_runs.c.state).where(t_runs.c.id == run_id)).scalar_one_or_none()
        if state is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return RunState(state)

    def list_runs(self, limit: int = 20, *, tenant: str | None = None) -> list[RunView]:
        q = sa.select(t_runs).order_by(t_runs.c.created_at.desc()).limit(limit)
        if tenant:
            q = q.where(t_runs.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_run_view(r, {}) for r in conn.execute(q)]

    def get_tasks(self, run_id: str) -> list[TaskView]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t_tasks).where(t_tasks.c.run_id == run_id).order_by(t_tasks.c.started_at, t_tasks.c.key)
            ).all()
        return [_task_view(r) for r in rows]

    def get_task(self, run_id: str, key: str) -> TaskView:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t_tasks).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)).first()
        if row is None:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return _task_view(row)

    def events(self, run_id: str) -> list[EventView]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t_events).where(t_events.c.run_id == run_id).order_by(t_events.c.id)).all()
        return [
            EventView(r.key, r.attempt, r.from_state, r.to_state, r.actor, r.reason, r.accepted, aware(r.at))
            for r in rows
        ]


def _event(
    run_id: str,
    key: str,
    attempt: int,
    src: TaskState | None,
    dst: TaskState,
    actor: str,
    reason: str | None,
    accepted: bool,
    at: Any,
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "key": key,
        "attempt": attempt,
        "from_state": src.value if src else None,
        "to_state": dst.value,
        "actor": actor,
        "reason": reason,
        "accepted": accepted,
        "at": at,
    }


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
