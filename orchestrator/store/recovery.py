"""What the reconciler does to the database: due retries, lost dispatches, expired leases,
runs whose counter missed their end, and the watchdog's flags (tasks no worker can take, messages
re-published without a claim, runs with no transition: ``stuck``). Every action is a compare-and-set, so two reconcilers
acting on the same item act once: the loser records a rejected event."""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from ..core.models import RECONCILER, Dispatch, Outcome
from ..core.states import STUCK, TERMINAL, RunState, TaskState
from ..core.workers import dropped_text, pinned_text, split_pinned, unregistered_text
from . import rows, shards
from . import schema as s
from .admission import Admission
from .attempts import Attempts
from .database import Database
from .dbtime import db_after, db_now
from .ledger import Ledger, holds
from .settlement import Settlement
from .shards import Fence

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

    def release_due_retries(self, fence: Fence | None = None) -> int:
        """CAS RETRYING -> READY for retries whose ``not_before`` has passed; returns how many.
        They are admitted with the rest of the READY backlog (``Admission``).

        With ``fence`` (the sharded reconciler): only the runs of the shards it still holds at
        the epochs it read, locked ``FOR SHARE`` in this transaction; the due retries of a shard
        that moved get a rejected ledger row naming the stale epoch instead."""

        def tx(conn: Connection) -> int:
            where: tuple[Any, ...] = (t_tasks.c.not_before <= db_now(),)
            if fence is not None:
                valid, refused = shards.hold(conn, fence)
                if refused:
                    due = (t_tasks.c.state == T.RETRYING.value, *where)
                    shards.refuse_tasks(conn, fence, refused, due, T.READY.value)
                if not valid:
                    return 0
                where += (fence.only(valid).where(t_tasks.c.run_id),)
            moved = self.ledger.move_many(
                conn,
                where,
                T.RETRYING,
                T.READY,
                RECONCILER,
                reason="retry due",
                values={"ready_at": db_now()},
            )
            return len(moved)

        return self.db.transaction(tx)

    def stale_queued(self, dispatch_timeout: float, limit: int = 500, fence: Fence | None = None) -> list[Stale]:
        """QUEUED tasks whose message looks lost: (run, key, attempt, dispatched_at, overtaken).

        Unclaimed for longer than ``dispatch_timeout`` is not enough: with a dispatch depth
        above 1 a message may wait behind long tasks. A QUEUED task counts as lost when, past
        the timeout, either a task published *later* to its queue is already running (the
        broker delivers a queue in order, so this one was skipped), or the workers that
        consume its queue have an idle slot (nothing is in the way). A deep backlog behind
        busy slots is neither, and is never re-published. ``overtaken`` is the first, certain,
        case; an idle slot is one instant's look (between a task's end and the next claim a busy
        slot looks idle too), which the reconciler confirms on a later pass before it acts.
        With ``fence``: the runs of its shards only.
        """
        mine = () if fence is None else (fence.where(t_tasks.c.run_id),)
        with self.db.engine.connect() as conn:
            candidates = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.dispatched_at, t_tasks.c.queue)
                .where(t_tasks.c.state == T.QUEUED.value, t_tasks.c.dispatched_at < db_after(-dispatch_timeout), *mine)
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

    def redispatch(
        self, run_id: str, key: str, attempt: int, dispatched_at: Any, fence: Fence | None = None
    ) -> Dispatch | None:
        """CAS QUEUED -> QUEUED (same attempt, new ``dispatched_at``) for one stale task.

        ``dispatched_at`` is the version read by :meth:`stale_queued`: of two reconcilers
        that saw the same stale row, one re-publishes and the other loses (rejected event).
        With ``fence``: refused (a rejected event naming the stale epoch) unless the run's shard
        is still held at the epoch read (:func:`shards.check`, in this transaction).
        """

        def tx(conn: Connection) -> Dispatch | None:
            if fence is not None and (stale := shards.check(conn, fence, run_id)) is not None:
                self.ledger.reject(conn, run_id, key, attempt, T.QUEUED, RECONCILER, stale)
                return None
            moved = self.ledger.move(
                conn, run_id, key, attempt, T.QUEUED, T.QUEUED, RECONCILER,
                reason="unclaimed past the dispatch timeout: re-published",
                values={"dispatched_at": db_now()},
                fence=(t_tasks.c.dispatched_at == dispatched_at,),
                returning=rows.DISPATCH_COLUMNS,
            )  # fmt: skip
            return rows.dispatch(moved.row._mapping) if moved else None

        return self.db.transaction(tx)

    def expired_leases(self, limit: int = 500, fence: Fence | None = None) -> list[tuple[str, str, int]]:
        """RUNNING attempts whose lease deadline (``lease_expires_at``) has passed (with
        ``fence``: of the runs of its shards)."""
        mine = () if fence is None else (fence.where(t_tasks.c.run_id),)
        with self.db.engine.connect() as conn:
            found = conn.execute(
                sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt)
                .where(t_tasks.c.state == T.RUNNING.value, t_tasks.c.lease_expires_at < db_now(), *mine)
                .limit(limit)
            ).all()
        return [(r.run_id, r.key, r.attempt) for r in found]

    def lose_lease(self, run_id: str, key: str, attempt: int, window: int, fence: Fence | None = None) -> Outcome:
        """Fail an attempt whose lease expired: RETRYING with backoff, FAILED when attempts are
        exhausted, DEAD_LETTER after ``crash_loop_threshold`` consecutive lost leases.
        Re-checks the deadline inside the CAS, so a heartbeat that just landed wins. With
        ``fence``: refused like :meth:`redispatch` once the run's shard moved."""

        def tx(conn: Connection) -> Outcome:
            if fence is not None and (stale := shards.check(conn, fence, run_id)) is not None:
                return Outcome(
                    False, None, [], self.ledger.reject(conn, run_id, key, attempt, T.RETRYING, RECONCILER, stale)
                )
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

    def finalize_runs(self, limit: int = 100, fence: Fence | None = None) -> int:
        """Close RUNNING runs whose tasks are all terminal (safety net for the counter). With
        ``fence``: the runs of its shards, each refused (a rejected run event naming the stale
        epoch) once its shard moved. Returns how many runs it closed."""
        open_task = (
            sa.select(t_tasks.c.key)
            .where(t_tasks.c.run_id == t_runs.c.id, t_tasks.c.state.not_in([st.value for st in TERMINAL]))
            .exists()
        )
        mine = () if fence is None else (fence.where(t_runs.c.id),)
        with self.db.engine.connect() as conn:
            ids = conn.execute(
                sa.select(t_runs.c.id).where(t_runs.c.state == RunState.RUNNING.value, ~open_task, *mine).limit(limit)
            ).scalars().all()  # fmt: skip
        return sum(self.db.transaction(functools.partial(self._recount, run_id, fence)) for run_id in ids)

    def _recount(self, run_id: str, fence: Fence | None, conn: Connection) -> bool:
        if fence is not None and (stale := shards.check(conn, fence, run_id)) is not None:
            shards.refuse_run(conn, run_id, RunState.RUNNING.value, RunState.RUNNING.value, f"closing the run: {stale}")
            return False
        self.settlement.close_tasks(conn, run_id, 0, RECONCILER, recount=True)
        return True

    # ------------------------------------------------------------------ the watchdog

    def flag_republished(self, run_id: str, key: str, attempt: int, limit: int) -> Stuck | None:
        """After a re-publish: when the attempt's message has now been re-published ``limit``
        times since its admission without a claim, flag the task (``stuck``, an annotation in
        the ledger, the run's ``stuck``) and return what to alert; ``None`` otherwise (or when
        it is flagged already)."""
        if limit <= 0:
            return None

        def tx(conn: Connection) -> Stuck | None:
            n = int(conn.execute(_REPUBLISHED, {"run_id": run_id, "key": key, "attempt": attempt}).scalar_one())
            if n < limit:
                return None
            detail = (
                f"re-published {n} times without a claim (each after the dispatch timeout): no worker took its"
                " message; see the workers of its queue and their logs"
            )
            return self._flag(conn, run_id, key, attempt, T.QUEUED, "republished", detail, {"republished": n})

        return self.db.transaction(tx)

    def watch(self, idle_seconds: float, *, scan_ready: bool, limit: int = 500) -> list[Stuck]:
        """The watchdog's pass: clear the flags of tasks that moved on, then flag READY tasks no
        live worker of their queue can take (never registered there, or dropped by a worker
        that lacks them; the READY backlog is read only with ``scan_ready``, the dropped ones
        always) and, with ``idle_seconds`` > 0, RUNNING runs with no transition for that long
        while no task of theirs waits on a named thing (RUNNING, WAITING, RETRYING or
        DEAD_LETTER). Returns the new flags, each alerted once (a flag is set only where none
        is: two reconcilers flag once)."""
        # one transaction: the flags cleared and what to flag read (a pass costs one more)
        with self.db.engine.begin() as conn:
            if conn.execute(_CLEAR_TASKS).scalars().all():
                conn.execute(_CLEAR_RUNS)
            held = list(conn.execute(_UNREGISTERED_DROPPED, {"limit": limit}).all())
            if scan_ready:
                held += conn.execute(_UNREGISTERED, {"limit": limit}).all()
            idle: list[str] = []
            if idle_seconds > 0:
                idle = list(conn.execute(_IDLE_RUNS, {"idle": idle_seconds, "limit": 100}).scalars().all())
        found: list[Stuck] = []
        for row in {(r.run_id, r.key): r for r in held}.values():
            found += filter(None, [self.db.transaction(functools.partial(self._flag_unregistered, row))])
        for run_id in idle:
            found += filter(None, [self.db.transaction(functools.partial(self._flag_idle, run_id, idle_seconds))])
        return found

    def _flag_unregistered(self, row: Any, conn: Connection) -> Stuck | None:
        workers = conn.execute(_WORKERS_ON, {"queue": row.queue}).scalars().all()
        data: dict[str, Any] = {"queue": row.queue, "task_name": row.task_name, "workers": list(workers)}
        base, version = split_pinned(row.queue)
        if row.dropped_by is not None:
            having = [w for w, names in _names(conn, row.queue).items() if names is None or row.task_name in names]
            detail = dropped_text(row.dropped_by, row.task_name, row.queue, having)
        elif version is not None:  # a pinned run's task: which versions the workers of its queue have
            versions = {w: v for w, v in conn.execute(_VERSIONS_ON, {"queue": base}).all()}
            detail = pinned_text(base, version, row.task_name, versions)
            data.update(code_version=version, unpinned_queue=base, versions=versions)
        else:
            detail = unregistered_text(row.queue, row.task_name, workers)
        return self._flag(conn, row.run_id, row.key, row.attempt, T.READY, "unregistered", detail, data)

    def _flag_idle(self, run_id: str, idle_seconds: float, conn: Connection) -> Stuck | None:
        detail = (
            f"no transition for {idle_seconds:g}s while no task of the run is RUNNING, WAITING, RETRYING or"
            " DEAD_LETTER: nothing it waits on is named (see orchestrator explain)"
        )
        open_tasks = conn.execute(
            sa.select(t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.state).where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.state.in_([T.PENDING.value, T.READY.value, T.QUEUED.value]),
                t_tasks.c.stuck.is_(None),
            )
        ).all()
        first = None
        for t in open_tasks:
            flag = self._flag(conn, run_id, t.key, t.attempt, T(t.state), "idle", detail, {})
            first = first or flag
        if first is None:
            return None
        return first._replace(key=None)

    def _flag(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        state: TaskState,
        kind: str,
        detail: str,
        data: dict[str, Any],
    ) -> Stuck | None:
        flag = sa.func.jsonb_build_object(
            "kind", kind, "detail", detail, "state", state.value, "attempt", attempt, "at", db_now(),
            "data", sa.cast(json.dumps(data), postgresql.JSONB),
        )  # fmt: skip
        row = conn.execute(
            t_tasks.update()
            .where(*holds(run_id, key, state, attempt), t_tasks.c.stuck.is_(None))
            .values(stuck=flag)
            .returning(t_tasks.c.tenant, t_tasks.c.task_name, t_tasks.c.queue)
        ).first()
        if row is None:
            return None
        self.ledger.annotate(conn, run_id, key, attempt, state.value, RECONCILER, STUCK, f"{kind}: {detail}")
        dag = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id, t_runs.c.stuck.is_(None))
            .values(stuck=f"{key}: {detail}")
            .returning(t_runs.c.dag_name)
        ).scalar()
        return Stuck(run_id, key, attempt, state.value, kind, detail, row.tenant, dag, row.task_name, row.queue)


class Stuck(NamedTuple):
    """A flag the watchdog set (``Recovery.watch``): what its alert says."""

    run_id: str
    key: str | None
    attempt: int
    state: str
    #: ``unregistered``, ``republished`` or ``idle``
    kind: str
    detail: str
    tenant: str
    dag: str | None
    task_name: str
    queue: str

    def alert(self) -> dict[str, Any]:
        """The ``task_stuck`` alert's payload (``alerts.raise_alert``)."""
        return {"event": "task_stuck", **self._asdict()}


def _names(conn: Connection, queue: str) -> dict[str, list[str] | None]:
    out: dict[str, list[str] | None] = {}
    for worker, name in conn.execute(_NAMES_ON, {"queue": queue}).all():
        names = out.setdefault(worker, [])
        if name == "*":
            out[worker] = None
        elif names is not None:
            names.append(name)
    return out


#: accepted re-publishes of an attempt since its latest admission (READY -> QUEUED)
_REPUBLISHED = sa.text(
    """
    SELECT count(*) FROM orc_task_events e
    WHERE e.run_id = :run_id AND e.key = :key AND e.attempt = :attempt AND e.accepted AND e.kind IS NULL
      AND e.from_state = 'QUEUED' AND e.to_state = 'QUEUED'
      AND e.id > coalesce((SELECT max(a.id) FROM orc_task_events a
                           WHERE a.run_id = :run_id AND a.key = :key AND a.accepted
                             AND a.from_state = 'READY' AND a.to_state = 'QUEUED'), 0)
    """
)
#: a live worker's (queue, task name) row takes the task: its name, or '*' (admission's test)
_TAKES = "EXISTS (SELECT 1 FROM orc_worker_tasks k WHERE k.queue = t.queue AND k.task_name IN (t.task_name, '*'))"
#: a live worker consumes the queue (else explain's no_worker names it; nothing is flagged)
_CONSUMED = "EXISTS (SELECT 1 FROM orc_worker_tasks k WHERE k.queue = t.queue)"
_UNREGISTERED_DROPPED = sa.text(
    "SELECT t.run_id, t.key, t.attempt, t.task_name, t.queue, t.dropped_by FROM orc_tasks t"
    " WHERE t.dropped_by IS NOT NULL AND t.state = 'READY' AND t.stuck IS NULL LIMIT :limit"
)
_UNREGISTERED = sa.text(
    "SELECT t.run_id, t.key, t.attempt, t.task_name, t.queue, t.dropped_by FROM orc_tasks t"
    f" WHERE t.state = 'READY' AND t.stuck IS NULL AND {_CONSUMED} AND NOT {_TAKES} LIMIT :limit"
)
_WORKERS_ON = sa.text("SELECT DISTINCT k.worker FROM orc_worker_tasks k WHERE k.queue = :queue ORDER BY 1")
_VERSIONS_ON = sa.text(
    "SELECT DISTINCT k.worker, w.code_version FROM orc_worker_tasks k JOIN orc_workers w ON w.name = k.worker"
    " WHERE k.queue = :queue ORDER BY 1"
)
_NAMES_ON = sa.text("SELECT k.worker, k.task_name FROM orc_worker_tasks k WHERE k.queue = :queue ORDER BY 1, 2")
#: flags whose task moved on: another state or attempt, a READY task a worker can take again, a
#: run with a transition since the idle flag
_CLEAR_TASKS = sa.text(
    f"""
    UPDATE orc_tasks t SET stuck = NULL
    WHERE t.stuck IS NOT NULL AND (
        t.state <> t.stuck ->> 'state' OR t.attempt <> (t.stuck ->> 'attempt')::int
        OR (t.stuck ->> 'kind' = 'unregistered' AND t.dropped_by IS NULL AND {_TAKES})
        OR (t.stuck ->> 'kind' = 'idle' AND EXISTS (
            SELECT 1 FROM orc_task_events e WHERE e.run_id = t.run_id AND e.kind IS NULL
                AND e.at > (t.stuck ->> 'at')::timestamptz)))
    RETURNING t.run_id
    """
)
_CLEAR_RUNS = sa.text(
    "UPDATE orc_runs r SET stuck = NULL WHERE r.stuck IS NOT NULL"
    " AND NOT EXISTS (SELECT 1 FROM orc_tasks t WHERE t.run_id = r.id AND t.stuck IS NOT NULL)"
)
_IDLE_RUNS = sa.text(
    """
    SELECT r.id FROM orc_runs r
    WHERE r.state = 'RUNNING' AND r.stuck IS NULL AND r.held IS NULL
      AND r.created_at < now() - make_interval(secs => :idle)
      AND NOT EXISTS (SELECT 1 FROM orc_tasks t WHERE t.run_id = r.id
                      AND t.state IN ('RUNNING', 'WAITING', 'RETRYING', 'DEAD_LETTER'))
      AND NOT EXISTS (SELECT 1 FROM orc_task_events e WHERE e.run_id = r.id AND e.kind IS NULL
                      AND e.at > now() - make_interval(secs => :idle))
    ORDER BY r.created_at LIMIT :limit
    """
)
