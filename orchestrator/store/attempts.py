"""The worker side of a task attempt: claim, heartbeat, and the fenced outcome.

The attempt number is the fencing token: the claim, every heartbeat and the outcome are
compare-and-sets on it. The lease is one stored deadline (``lease_expires_at``), written by
the claim and pushed forward by each heartbeat; the reconciler reads nothing else to decide
that an attempt was lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.models import WORKER, Actor, Claim, Outcome
from ..core.poison import is_retryable, verdict
from ..core.states import TaskState, check_transition
from . import rows
from . import schema as s
from .admission import Admission
from .database import Database
from .dbtime import db_after, db_now
from .hotpath import HotPath
from .ledger import Ledger, holds
from .settlement import Settlement
from .transactional import TaskTransaction

T = TaskState
t_tasks, t_edges = s.tasks, s.edges

#: a failure counted by the breakers of the task's resources (``store/sql/breaker.sql``)
_BREAKER_COUNT = sa.text(
    "SELECT orc_breaker_v1(CAST(:res AS text[]), :run, :key, :attempt, true, CAST(:exc AS text[]), :actor)"
)


class Attempts:
    def __init__(
        self,
        db: Database,
        ledger: Ledger,
        settlement: Settlement,
        admission: Admission,
        *,
        poison_threshold: int,
        group_commit: bool = False,
    ) -> None:
        self.db = db
        self.ledger = ledger
        self.settlement = settlement
        self.admission = admission
        self.poison_threshold = poison_threshold
        #: the claim and the success are server functions (one round trip each)
        self.hot = HotPath(
            db.engine,
            retry_seconds=db.retry_seconds,
            pool_size=db.pool_size,
            prepare=not db.transaction_pooler,
            group_commit=group_commit,
        )

    def claim(
        self, run_id: str, key: str, attempt: int, worker: str, lease_seconds: float, task_name: str
    ) -> Claim | None:
        """CAS QUEUED -> RUNNING for ``attempt`` of a task named ``task_name`` (the message's
        task must be the node's) and set the lease.

        Returns ``None`` when the claim lost (unknown run or task, stale attempt, already
        claimed, another task's message): a rejected event is recorded when the task exists,
        nothing is written for an unknown one, and the caller must not run the body.
        """
        check_transition(T.QUEUED, T.RUNNING, WORKER.role)
        got = self.hot.claim(run_id, key, attempt, worker, lease_seconds, task_name)
        if not got["claimed"]:
            return None
        return Claim(
            run_id, key, attempt, list(got["args"]), dict(got["kwargs"]), bool(got["wants_upstream"]),
            dict(got["upstream"]), got.get("sensor"), got.get("resumed"), bool(got.get("transactional")),
        )  # fmt: skip

    def heartbeat(self, run_id: str, key: str, attempt: int, lease_seconds: float) -> bool:
        """Push the lease deadline forward while the row still holds ``attempt`` in RUNNING;
        ``False`` if it does not (the attempt was taken over: stop the body)."""
        with self.db.engine.begin() as conn:
            res = conn.execute(
                t_tasks.update()
                .where(*holds(run_id, key, T.RUNNING, attempt))
                .values(heartbeat_at=db_now(), lease_expires_at=db_after(lease_seconds))
            )
            return res.rowcount == 1

    def succeed(
        self,
        run_id: str,
        key: str,
        attempt: int,
        result: Any,
        window: int,
        *,
        claim: tuple[str, str, float] | None = None,
    ) -> Outcome:
        """CAS RUNNING -> SUCCEEDED with ``result``, settle the children, admit ready tasks
        (``orc_succeed_v2``). A result its node cannot use (a branch naming no direct child, a
        map's parent returning no list) fails the attempt instead, without a retry, its error
        the server's ``BranchError`` / ``MapError``.

        ``claim`` = ``(worker, task_name, elapsed seconds)``: the body of a direct message ran
        unclaimed, and the claim (QUEUED -> RUNNING, refused as :meth:`claim` refuses) is made in
        the same statement (``orc_claim_succeed_v1``)."""
        check_transition(T.RUNNING, T.SUCCEEDED, WORKER.role)
        a = self.admission
        if claim is not None:
            check_transition(T.QUEUED, T.RUNNING, WORKER.role)
            worker, task_name, elapsed = claim
            out = self.hot.claim_succeed(
                run_id, key, attempt, worker, task_name, elapsed, result, window, a.worker_ttl, a.depth, a.aging
            )
        else:
            out = self.hot.succeed(run_id, key, attempt, result, window, a.worker_ttl, a.depth, a.aging)
        if not out["accepted"]:
            if out.get("invalid"):
                return self.fail(run_id, key, attempt, error=out["invalid"], window=window, retryable=False)
            return Outcome(False, None, [], out["conflict"])
        return Outcome(True, T.SUCCEEDED, [rows.dispatch(d) for d in out["dispatches"]])

    def begin(self, run_id: str, key: str, attempt: int, lease_seconds: float) -> TaskTransaction:
        """A transactional attempt's transaction (:mod:`.transactional`), open on a connection of
        the store's pool; its body's writes commit with :meth:`succeed_in` or not at all."""
        return TaskTransaction.open(self.db.engine, run_id, key, attempt, lease_seconds)

    def succeed_in(self, txn: TaskTransaction, result: Any, window: int) -> Outcome:
        """CAS RUNNING -> SUCCEEDED in the attempt's own transaction ``txn``, with its body's
        writes: committed together, or all rolled back when the attempt was fenced. The refusal's
        rejected event (rolled back with the rest) is then written alone; a result the node cannot
        use fails the attempt without a retry, as :meth:`succeed` does."""
        check_transition(T.RUNNING, T.SUCCEEDED, WORKER.role)
        a = self.admission
        run_id, key, attempt = txn.run_id, txn.key, txn.attempt
        out = txn.succeed(result, window, a.worker_ttl, a.depth, a.aging)
        if out["accepted"]:
            return Outcome(True, T.SUCCEEDED, [rows.dispatch(d) for d in out["dispatches"]])
        if out.get("invalid"):
            return self.fail(run_id, key, attempt, error=out["invalid"], window=window, retryable=False)
        why = "transactional attempt fenced: its writes rolled back"
        conflict = self.db.transaction(lambda c: self.ledger.reject(c, run_id, key, attempt, T.SUCCEEDED, WORKER, why))
        return Outcome(False, None, [], conflict)

    def skip(self, run_id: str, key: str, attempt: int, reason: str, window: int) -> Outcome:
        """CAS RUNNING -> SKIPPED (the body raised :class:`orchestrator.Skip`), settle the
        children, admit ready tasks (``orc_skip_v1``)."""
        check_transition(T.RUNNING, T.SKIPPED, WORKER.role)
        a = self.admission
        out = self.hot.skip(run_id, key, attempt, reason, window, a.worker_ttl, a.depth, a.aging)
        if not out["accepted"]:
            return Outcome(False, None, [], out["conflict"])
        return Outcome(True, T.SKIPPED, [rows.dispatch(d) for d in out["dispatches"]])

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
        actor: Actor = WORKER,
    ) -> Outcome:
        """Record a failed attempt, fenced by ``attempt``.

        The verdict (:func:`orchestrator.core.poison.verdict`): DEAD_LETTER when the same
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
                    t_tasks.c.fingerprint_streak, t_tasks.c.retry_on, t_tasks.c.no_retry_on, t_tasks.c.resources,
                ).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
            ).first()  # fmt: skip
            if row is None:
                return Outcome(False, None, [], self.ledger.reject(conn, run_id, key, attempt, T.FAILED, actor, error))
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
            out = self.finish(conn, run_id, key, attempt, state, actor, error, common, row.backoff, window)
            if out.accepted and row.resources:
                # the resources' breakers count the failure in this transaction (after the admission:
                # the admission lock before a breaker's row, as on the success path)
                conn.execute(
                    _BREAKER_COUNT,
                    {"res": list(row.resources), "run": run_id, "key": key, "attempt": attempt,
                     "exc": list(exc_types), "actor": actor.role},
                )  # fmt: skip
            return out

        return self.db.transaction(tx)

    def finish(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        state: TaskState,
        actor: Actor,
        error: str,
        values: dict[str, Any],
        backoff: dict[str, Any],
        window: int,
    ) -> Outcome:
        """Move a RUNNING attempt to the failure ``state`` the caller decided (RETRYING with
        backoff, DEAD_LETTER, or FAILED with its consequences downstream), then admit."""
        values = {**values, "lease_expires_at": None}
        reason = error
        if state is T.RETRYING:
            delay = rows.backoff(backoff).delay(attempt)
            reason = f"{error} (retry in {delay:.2f}s)"
            values.update(attempt=attempt + 1, not_before=db_after(delay))
        elif state is T.DEAD_LETTER:
            reason = f"dead letter: {error}"
        else:
            values["finished_at"] = db_now()
        moved = self.ledger.move(conn, run_id, key, attempt, T.RUNNING, state, actor, reason=reason, values=values)
        if not moved:
            return Outcome(False, None, [], moved.conflict)
        if state is T.FAILED:
            self.settlement.settle(conn, run_id, [(key, T.FAILED, moved.row.children or [])], actor)
        return Outcome(True, state, self.admission.admit(conn, window))
