"""What the reconciler does to the database: due retries, lost dispatches, expired leases,
runs whose counter missed their end. Every action is a compare-and-set, so two reconcilers
acting on the same item act once: the loser records a rejected event."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import schema as s
from ..dbtime import db_after, db_now
from ..models import RECONCILER, Dispatch, Outcome
from ..states import TERMINAL, RunState, TaskState
from . import rows
from .admission import Admission
from .attempts import Attempts
from .database import Database
from .ledger import Ledger, holds
from .settlement import Settlement

T = TaskState
t_tasks, t_runs = s.tasks, s.runs


class Stale(NamedTuple):
    """A QUEUED task unclaimed past the dispatch timeout that looks lost (see ``stale_queued``)."""

    run_id: str
    key: str
    attempt: int
    dispatched_at: Any
    #: a task published later to its queue already runs: certainly skipped (else: an idle slot)
    overtaken: bool


class Recovery:
    def __init__(
        self,
        db: Database,
        ledger: Ledger,
        settlement: Settlement,
        admission: Admission,
        attempts: Attempts,
        *,
        crash_loop_threshold: int,
    ) -> None:
        self.db = db
        self.ledger = ledger
        self.settlement = settlement
        self.admission = admission
        self.attempts = attempts
        self.crash_loop_threshold = crash_loop_threshold

    def release_due_retries(self) -> int:
        """CAS RETRYING -> READY for retries whose ``not_before`` has passed; returns how many.
        They are admitted with the rest of the READY backlog (``Admission``)."""

        def tx(conn: Connection) -> int:
            moved = self.ledger.move_many(
                conn,
                (t_tasks.c.not_before <= db_now(),),
                T.RETRYING,
                T.READY,
                RECONCILER,
                reason="retry due",
                values={"ready_at": db_now()},
            )
            return len(moved)

        return self.db.transaction(tx)

    def stale_queued(self, dispatch_timeout: float, limit: int = 500) -> list[Stale]:
        """QUEUED tasks whose message looks lost: (run, key, attempt, dispatched_at, overtaken).

        Unclaimed for longer than ``dispatch_timeout`` is not enough: with a dispatch depth
        above 1 a message may wait behind long tasks. A QUEUED task counts as lost when, past
        the timeout, either a task published *later* to its queue is already running (the
        broker delivers a queue in order, so this one was skipped), or the workers that
        consume its queue have an idle slot (nothing is in the way). A deep backlog behind
        busy slots is neither, and is never re-published. ``overtaken`` is the first, certain,
        case; an idle slot is one instant's look (between a task's end and the next claim a busy
        slot looks idle too), which the reconciler confirms on a later pass before it acts.
        """
        with self.db.engine.connect() as conn:
            candidates = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.dispatched_at, t_tasks.c.queue)
                .where(t_tasks.c.state == T.QUEUED.value, t_tasks.c.dispatched_at < db_after(-dispatch_timeout))
                .order_by(t_tasks.c.dispatched_at)
                .limit(limit)
            ).all()
            if not candidates:
                return []
            running = {
                queue: (int(n), newest)
                for queue, n, newest in conn.execute(
                    sa.select(t_tasks.c.queue, sa.func.count(), sa.func.max(t_tasks.c.dispatched_at))
                    .where(t_tasks.c.state == T.RUNNING.value)
                    .group_by(t_tasks.c.queue)
                ).all()
            }
            groups = self.admission.capacity(conn)
        lost = []
        for c in candidates:
            newest = running.get(c.queue, (0, None))[1]
            overtaken = newest is not None and newest > c.dispatched_at
            serving = [(queues, slots) for queues, slots in groups.items() if c.queue in queues]
            slots = sum(n for _, n in serving)
            used = sum(running.get(q, (0, None))[0] for q in set().union(*(qs for qs, _ in serving)))
            if overtaken or used < slots:
                lost.append(Stale(c.run_id, c.key, c.attempt, c.dispatched_at, overtaken))
        return lost

    def redispatch(self, run_id: str, key: str, attempt: int, dispatched_at: Any) -> Dispatch | None:
        """CAS QUEUED -> QUEUED (same attempt, new ``dispatched_at``) for one stale task.

        ``dispatched_at`` is the version read by :meth:`stale_queued`: of two reconcilers
        that saw the same stale row, one re-publishes and the other loses (rejected event).
        """

        def tx(conn: Connection) -> Dispatch | None:
            moved = self.ledger.move(
                conn, run_id, key, attempt, T.QUEUED, T.QUEUED, RECONCILER,
                reason="unclaimed past the dispatch timeout: re-published",
                values={"dispatched_at": db_now()},
                fence=(t_tasks.c.dispatched_at == dispatched_at,),
                returning=rows.DISPATCH_COLUMNS,
            )  # fmt: skip
            return rows.dispatch(moved.row._mapping) if moved else None

        return self.db.transaction(tx)

    def expired_leases(self, limit: int = 500) -> list[tuple[str, str, int]]:
        """RUNNING attempts whose lease deadline (``lease_expires_at``) has passed."""
        with self.db.engine.connect() as conn:
            found = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt)
                .where(t_tasks.c.state == T.RUNNING.value, t_tasks.c.lease_expires_at < db_now())
                .limit(limit)
            ).all()
        return [(r.run_id, r.key, r.attempt) for r in found]

    def lose_lease(self, run_id: str, key: str, attempt: int, window: int) -> Outcome:
        """Fail an attempt whose lease expired: RETRYING with backoff, FAILED when attempts are
        exhausted, DEAD_LETTER after ``crash_loop_threshold`` consecutive lost leases.
        Re-checks the deadline inside the CAS, so a heartbeat that just landed wins."""

        def tx(conn: Connection) -> Outcome:
            row = conn.execute(
                sa.select(t_tasks.c.max_attempts, t_tasks.c.backoff, t_tasks.c.lease_losses, t_tasks.c.worker)
                .where(*holds(run_id, key, T.RUNNING, attempt), t_tasks.c.lease_expires_at < db_now())
                .with_for_update()
            ).first()
            error = "LeaseExpired: no heartbeat for a whole lease (worker killed, paused or lost)"
            if row is None:
                conflict = self.ledger.reject(
                    conn, run_id, key, attempt, T.RETRYING, RECONCILER, error + "; lease is live"
                )
                return Outcome(False, None, [], conflict)
            losses = row.lease_losses + 1
            if self.crash_loop_threshold > 0 and losses >= self.crash_loop_threshold:
                state = T.DEAD_LETTER
                error = f"crash loop: lease lost on {losses} consecutive attempts (last on {row.worker})"
            else:
                state = T.RETRYING if attempt < row.max_attempts else T.FAILED
                error = f"{error} on {row.worker}"
            values = {"error": error, "lease_losses": losses, "fingerprint": None, "fingerprint_streak": 0}
            return self.attempts.finish(
                conn, run_id, key, attempt, state, RECONCILER, error, values, row.backoff, window
            )

        return self.db.transaction(tx)

    def finalize_runs(self, limit: int = 100) -> int:
        """Close RUNNING runs whose tasks are all terminal (safety net for the counter)."""
        open_task = (
            sa.select(t_tasks.c.key)
            .where(t_tasks.c.run_id == t_runs.c.id, t_tasks.c.state.not_in([st.value for st in TERMINAL]))
            .exists()
        )
        with self.db.engine.connect() as conn:
            ids = conn.execute(
                sa.select(t_runs.c.id).where(t_runs.c.state == RunState.RUNNING.value, ~open_task).limit(limit)
            ).scalars().all()  # fmt: skip
        for run_id in ids:
            self.db.transaction(functools.partial(self._recount, run_id))
        return len(ids)

    def _recount(self, run_id: str, conn: Connection) -> None:
        self.settlement.close_tasks(conn, run_id, 0, RECONCILER, recount=True)
