"""Reconciler, operator and worker-registry operations of the store (see ``store_core``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .dbtime import db_after, db_now
from .errors import OperatorError, RunNotFound, TaskNotFound
from .models import Dispatch, task_id
from .states import TERMINAL, RunState, TaskState, check_transition
from .store_core import (
    _DISPATCH_COLUMNS,
    _EVENTS_AT_DB_NOW,
    Outcome,
    StoreCore,
    T,
    _dispatch,
    _event,
    holds,
    t_edges,
    t_effects,
    t_runs,
    t_tasks,
    t_workers,
)


class RecoveryOps(StoreCore):
    """What the reconciler and operators do to tasks and runs, and the worker registry."""

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
                .where(*holds(run_id, key, T.QUEUED, attempt), t_tasks.c.dispatched_at == dispatched_at)
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
                .where(*holds(run_id, key, T.RUNNING, attempt), last_seen < db_after(-lease_seconds))
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
            ok = (
                self._cas(conn, run_id, key, task.attempt, src, T.READY, "operator", "manual retry", values) is not None
            )
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
            moved = self._cas(conn, run_id, key, task.attempt, T.DEAD_LETTER, to, "operator", reason, values)
            if moved is None:
                return Outcome(False, None, [])
            self._settle(conn, run_id, [(key, to, moved.children or [])])
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
            if run.state != RunState.RUNNING.value:
                raise OperatorError(f"run {run_id} is already {run.state}: only a RUNNING run can be cancelled")
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
            if rows:
                why = "run cancelled"
                conn.execute(
                    _EVENTS_AT_DB_NOW,
                    [
                        _event(run_id, r.key, r.attempt, TaskState(r.state), T.CANCELLED, "operator", why, True)
                        for r in rows
                    ],
                )
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
