"""Persistence facade: submit, the worker side and reads.

The store is three layers (``store_core``, ``store_recovery``, this module) under one
contract, stated in ``store_core``. SQL lives in these three modules and nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .dag import DAG
from .dbtime import aware, db_after, db_now
from .errors import RunNotFound, TaskNotFound
from .models import Claim, EventView, RunView, TaskView
from .poison import is_retryable, verdict
from .states import (
    RunState,
)
from .store_core import (
    _EVENTS_AT_DB_NOW,
    T,
    _event,
    _run_view,
    _task_view,
    holds,
    t_edges,
    t_events,
    t_runs,
    t_tasks,
)
from .store_core import Outcome as Outcome
from .store_core import make_engine as make_engine
from .store_core import new_run_id as new_run_id
from .store_recovery import RecoveryOps


class Store(RecoveryOps):
    """The persistence facade over one database (Postgres or SQLite)."""

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
            children: dict[str, list[str]] = {}
            for node in dag.nodes.values():
                for parent in node.upstream:
                    children.setdefault(parent, []).append(node.key)
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
                        "children": children.get(node.key),
                        "retry_on": list(node.retry_on) or None,
                        "no_retry_on": list(node.no_retry_on) or None,
                    }
                )
                edge_rows.extend({"run_id": run_id, "parent_key": p, "child_key": node.key} for p in node.upstream)
                if root:
                    event_rows.append(_event(run_id, node.key, 1, T.PENDING, T.READY, "submit", "root", True))
            self._bulk_insert(conn, t_tasks, rows)
            if edge_rows:
                self._bulk_insert(conn, t_edges, edge_rows)
            conn.execute(_EVENTS_AT_DB_NOW, event_rows)
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

    def _bulk_insert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
        """Insert many rows: COPY on Postgres (a 10,000-node DAG in one stream), else executemany."""
        if not self.is_postgres:
            conn.execute(table.insert(), rows)
            return
        columns = list(rows[0])
        as_json = [isinstance(table.c[c].type, sa.JSON) for c in columns]
        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cursor, cursor.copy(f"COPY {table.name} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(
                    [
                        json.dumps(row[c]) if j and row[c] is not None else row[c]
                        for c, j in zip(columns, as_json, strict=True)
                    ]
                )

    # ------------------------------------------------------------------ worker side

    def claim(self, run_id: str, key: str, attempt: int, worker: str, lease_seconds: float) -> Claim | None:
        """CAS QUEUED -> RUNNING for ``attempt`` and set the lease.

        Returns ``None`` when the claim lost (unknown run or task, stale attempt, already
        claimed): a rejected event is recorded and the caller must not run the body.
        """

        def tx(conn: Connection) -> Claim | None:
            values = {
                "started_at": db_now(),
                "heartbeat_at": db_now(),
                "lease_expires_at": db_after(lease_seconds),
                "worker": worker,
            }
            returning = (t_tasks.c.args, t_tasks.c.kwargs, t_tasks.c.wants_upstream)
            reason = f"claim by {worker}"
            row = self._cas(conn, run_id, key, attempt, T.QUEUED, T.RUNNING, "worker", reason, values, returning)
            if row is None:
                return None
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
            return Claim(run_id, key, attempt, list(row.args), dict(row.kwargs), bool(row.wants_upstream), upstream)

        return self.transaction(tx)

    def heartbeat(self, run_id: str, key: str, attempt: int, lease_seconds: float) -> bool:
        """Extend the lease while the row still holds ``attempt`` in RUNNING; ``False`` if not."""
        with self.engine.begin() as conn:
            res = conn.execute(
                t_tasks.update()
                .where(*holds(run_id, key, T.RUNNING, attempt))
                .values(heartbeat_at=db_now(), lease_expires_at=db_after(lease_seconds))
            )
            return res.rowcount == 1

    def succeed(self, run_id: str, key: str, attempt: int, result: Any, window: int) -> Outcome:
        """CAS RUNNING -> SUCCEEDED with ``result``, settle the children, admit ready tasks."""

        def tx(conn: Connection) -> Outcome:
            moved = self._cas(
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
            if moved is None:
                return Outcome(False, None, [])
            self._settle(conn, run_id, [(key, T.SUCCEEDED, moved.children or [])])
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
