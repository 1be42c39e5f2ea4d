"""Persistence: every read and write of the orchestrator's tables.

Contract: every task state change is one compare-and-set ``UPDATE ... WHERE state =
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
from .dag import DAG
from .dbtime import aware, db_after, db_now, register_sqlite_functions
from .errors import RunNotFound, SchemaMissingError, TaskNotFound
from .models import Claim, Dispatch, EventView, RunView, TaskView
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

    def __init__(self, url_or_engine: str | Engine, *, id_factory: Callable[[], str] = new_run_id) -> None:
        self.engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
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
        """CAS READY -> QUEUED for as many tasks as the in-flight window allows, in priority
        order; returns the messages to publish *after* the caller commits."""
        ready = conn.execute(sa.select(t_tasks.c.run_id).where(t_tasks.c.state == T.READY.value).limit(1)).first()
        if ready is None:
            return []
        inflight = conn.execute(
            sa.select(sa.func.count()).where(t_tasks.c.state.in_([T.QUEUED.value, T.RUNNING.value]))
        ).scalar_one()
        room = window - inflight
        if room <= 0:
            return []
        picked = (
            sa.select(t_tasks.c.run_id, t_tasks.c.key)
            .where(t_tasks.c.state == T.READY.value)
            .order_by(t_tasks.c.priority_rank, t_tasks.c.ready_at)
            .limit(room)
            .with_for_update(skip_locked=True)
            # a CTE is evaluated once; an IN (subquery) may be re-run per row and over-admit
            .cte("picked")
        )
        check_transition(T.READY, T.QUEUED, "dispatcher")
        rows = conn.execute(
            t_tasks.update()
            .where(
                t_tasks.c.run_id == picked.c.run_id,
                t_tasks.c.key == picked.c.key,
                t_tasks.c.state == T.READY.value,
            )
            .values(state=T.QUEUED.value, dispatched_at=db_now())
            .returning(
                t_tasks.c.run_id,
                t_tasks.c.key,
                t_tasks.c.attempt,
                t_tasks.c.task_name,
                t_tasks.c.args,
                t_tasks.c.kwargs,
                t_tasks.c.queue,
                t_tasks.c.soft_time_limit,
                t_tasks.c.time_limit,
                t_tasks.c.priority_rank,
                t_tasks.c.ready_at,
            )
        ).all()
        if not rows:
            return []
        # RETURNING has no order: publish in the order the rows were picked
        rows = sorted(rows, key=lambda r: (r.priority_rank, r.ready_at))
        now = conn.execute(sa.select(db_now())).scalar_one()
        conn.execute(
            t_events.insert(),
            [_event(r.run_id, r.key, r.attempt, T.READY, T.QUEUED, "dispatcher", None, True, now) for r in rows],
        )
        return [
            Dispatch(
                r.run_id,
                r.key,
                r.attempt,
                r.task_name,
                list(r.args),
                dict(r.kwargs),
                r.queue,
                r.soft_time_limit,
                r.time_limit,
            )
            for r in rows
        ]

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
        retry: bool,
        window: int,
        actor: str = "worker",
        fingerprint: str | None = None,
    ) -> Outcome:
        """Record a failed attempt: RETRYING (``attempt + 1``, ``not_before`` = now + backoff)
        while ``retry`` and attempts remain, else FAILED with its consequences downstream.
        Loses (``accepted=False``, rejected event) unless the row holds ``attempt`` RUNNING."""

        def tx(conn: Connection) -> Outcome:
            row = conn.execute(
                sa.select(t_tasks.c.max_attempts, t_tasks.c.backoff).where(
                    t_tasks.c.run_id == run_id, t_tasks.c.key == key
                )
            ).first()
            if row is not None and retry and attempt < row.max_attempts:
                delay = _backoff(row.backoff).delay(attempt)
                ok = self._cas(
                    conn,
                    run_id,
                    key,
                    attempt,
                    T.RUNNING,
                    T.RETRYING,
                    actor,
                    f"{error} (retry in {delay:.2f}s)",
                    {
                        "attempt": attempt + 1,
                        "not_before": db_after(delay),
                        "error": error,
                        "fingerprint": fingerprint,
                        "lease_expires_at": None,
                    },
                )
                return Outcome(ok, T.RETRYING if ok else None, [])
            ok = self._cas(
                conn,
                run_id,
                key,
                attempt,
                T.RUNNING,
                T.FAILED,
                actor,
                error,
                {"error": error, "fingerprint": fingerprint, "finished_at": db_now(), "lease_expires_at": None},
            )
            if not ok:
                return Outcome(False, None, [])
            self._settle(conn, run_id, [(key, T.FAILED)])
            return Outcome(True, T.FAILED, self.admit(conn, window))

        return self.transaction(tx)

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

    def _close_tasks(self, conn: Connection, run_id: str, closed: int) -> None:
        left = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id)
            .values(open_tasks=t_runs.c.open_tasks - closed)
            .returning(t_runs.c.open_tasks)
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
