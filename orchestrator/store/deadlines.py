"""Deadlines: the reconciler's verdict on every deadline that fell due, and the misses.

A run's deadline (the DAG's ``deadline``) and a task's (the node's) fall due at ``deadline_at``,
stored at submit. Once the database clock passes it, the reconciler judges it once:

- **met**: the run is final, or the task terminal, with ``finished_at <= deadline_at``. Only
  ``deadline_checked_at`` is set (:meth:`Deadlines.judge_met`, in bulk, no event).
- **missed**: the run is still RUNNING (the task not terminal), or it ended after
  ``deadline_at``. :meth:`Deadlines.record` sets ``deadline_checked_at`` and
  ``deadline_missed_at`` with a compare-and-set ``WHERE deadline_checked_at IS NULL`` and, in
  the same transaction, writes the miss's ledger row: an *annotation* event (``kind`` =
  ``deadline_missed``, ``from_state`` = ``to_state`` = the state the row held, actor
  ``reconciler``; see ``states.ANNOTATIONS``). Of two reconcilers judging the same deadline,
  exactly one's compare-and-set matches: a miss is recorded once, and alerted once.

The rows still to judge are found through the partial indexes ``ix_orc_runs_deadline_due`` and
``ix_orc_tasks_deadline_due`` (only rows with a deadline not judged yet), in due order, a
bounded batch per pass. A deadline that fell due while nobody reconciled is judged by the next
pass from the stored ``finished_at``, so a run that ended late between two passes is still a miss.

The annotation is not a state change: no ``state`` column is written here (the one writer of
state stays ``ledger.py``), and the event is checked against ``states.ANNOTATIONS``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.dag import OnDeadline
from ..core.models import RECONCILER
from ..core.states import DEADLINE_MISSED, TERMINAL, RunState
from . import schema as s
from .database import Database
from .dbtime import aware, db_now
from .ledger import RUN_EVENT_ATTEMPT, Ledger
from .shards import Fence, check, refuse_run

t_runs, t_tasks, t_events = s.runs, s.tasks, s.events
_TERMINAL = [st.value for st in TERMINAL]


def _pending(table: sa.Table) -> tuple[Any, ...]:
    """The predicate of the table's partial "deadline due" index, and the deadline has passed."""
    c = table.c
    return (c.deadline_at.is_not(None), c.deadline_checked_at.is_(None), c.deadline_at < db_now())


def _run_missed() -> Any:
    """A run missed its deadline (which has passed): not final, or final after it."""
    c = t_runs.c
    return sa.or_(c.state == RunState.RUNNING.value, sa.func.coalesce(c.finished_at, c.deadline_at) > c.deadline_at)


def _task_missed() -> Any:
    """A task missed its deadline (which has passed): not terminal (done), or done after it."""
    c = t_tasks.c
    return sa.or_(c.state.not_in(_TERMINAL), sa.func.coalesce(c.finished_at, c.deadline_at) > c.deadline_at)


@dataclass(frozen=True)
class Due:
    """A deadline that fell due and was missed, not recorded yet (:meth:`Deadlines.due`)."""

    run_id: str
    #: the node key for a task's deadline; ``None`` for the run's own
    key: str | None
    deadline_seconds: float
    deadline_at: dt.datetime
    dag: str
    tenant: str
    on_deadline: str
    run_state: str
    #: the state of the row whose deadline it is (the run's, for the run's deadline)
    state: str

    @property
    def cancels(self) -> bool:
        """The run is to be cancelled: its DAG says ``on_deadline="cancel"``, it is RUNNING and
        this deadline's run or task is not done. The miss is certain then (whenever it ends, it
        ends after the deadline), so the cancel may come before the miss is recorded: a crash
        in between leaves a cancelled row past its deadline, which the next pass records."""
        not_done = self.state == RunState.RUNNING.value if self.key is None else self.state not in _TERMINAL
        return self.on_deadline == OnDeadline.CANCEL.value and self.run_state == RunState.RUNNING.value and not_done


@dataclass(frozen=True)
class DeadlineMiss:
    """A recorded miss: its ledger row (``kind`` = ``deadline_missed``) and the deadline."""

    run_id: str
    #: the node key for a task's deadline; ``None`` for the run's own
    key: str | None
    #: the task's attempt when the miss was recorded (0 for a run)
    attempt: int
    dag: str
    tenant: str
    deadline_seconds: float
    due_at: dt.datetime
    #: when the miss was recorded (database time)
    missed_at: dt.datetime
    #: the state the run or task held then
    state: str
    on_deadline: str
    reason: str

    def alert(self) -> dict[str, Any]:
        """The alert payload (``alerts.raise_alert``): ``"event": "deadline_missed"``."""
        return {
            "event": DEADLINE_MISSED,
            "run_id": self.run_id,
            "dag": self.dag,
            "tenant": self.tenant,
            "key": self.key,
            "deadline_seconds": self.deadline_seconds,
            "due_at": iso_utc(self.due_at),
            "missed_at": iso_utc(self.missed_at),
            "state": self.state,
            "on_deadline": self.on_deadline,
            "reason": self.reason,
        }


class Deadlines:
    """The reconciler's deadline step and the reads of misses (see the module docstring)."""

    def __init__(self, db: Database, ledger: Ledger) -> None:
        self.db = db
        self.ledger = ledger

    # ------------------------------------------------------------------ the reconciler's step

    def judge_met(self, limit: int = 1000, fence: Fence | None = None) -> int:
        """Close the deadlines that fell due on runs and tasks done in time (verdict only, no
        event); returns how many. Bounded: at most ``limit`` rows of each table per call. With
        ``fence`` (the sharded reconciler): of the runs of its shards."""

        def tx(conn: Connection) -> int:
            r, t = t_runs.c, t_tasks.c
            mine_r = () if fence is None else (fence.where(r.id),)
            mine_t = () if fence is None else (fence.where(t.run_id),)
            met_runs = (
                sa.select(r.id)
                .where(*_pending(t_runs), r.state != RunState.RUNNING.value, ~_run_missed(), *mine_r)
                .limit(limit)
                .scalar_subquery()
            )
            runs = conn.execute(
                t_runs.update()
                .where(r.id.in_(met_runs), r.deadline_checked_at.is_(None))
                .values(deadline_checked_at=db_now())
            ).rowcount
            met_tasks = (
                sa.select(t.run_id, t.key)
                .where(*_pending(t_tasks), t.state.in_(_TERMINAL), ~_task_missed(), *mine_t)
                .limit(limit)
            )
            tasks = conn.execute(
                t_tasks.update()
                .where(sa.tuple_(t.run_id, t.key).in_(met_tasks), t.deadline_checked_at.is_(None))
                .values(deadline_checked_at=db_now())
            ).rowcount
            return int(runs or 0) + int(tasks or 0)

        return self.db.transaction(tx)

    def due(self, limit: int = 100, fence: Fence | None = None) -> list[Due]:
        """Deadlines that fell due and were missed but are not recorded yet, oldest first (at
        most ``limit`` runs and ``limit`` tasks; with ``fence``, of the runs of its shards)."""
        r, t = t_runs.c, t_tasks.c
        mine = () if fence is None else (fence.where(r.id),)

        def read(conn: Connection) -> list[Due]:
            runs = conn.execute(
                sa.select(r.id, r.deadline_seconds, r.deadline_at, r.dag_name, r.tenant, r.on_deadline, r.state)
                .where(*_pending(t_runs), _run_missed(), *mine)
                .order_by(r.deadline_at)
                .limit(limit)
            ).all()
            tasks = conn.execute(
                sa.select(
                    t.run_id, t.key, t.deadline_seconds, t.deadline_at, t.state,
                    r.dag_name, r.tenant, r.on_deadline, r.state.label("run_state"),
                )
                .join(t_runs, r.id == t.run_id)
                .where(*_pending(t_tasks), _task_missed(), *mine)
                .order_by(t.deadline_at)
                .limit(limit)
            ).all()  # fmt: skip
            found = [
                Due(x.id, None, float(x.deadline_seconds or 0), _utc(x.deadline_at), x.dag_name, x.tenant,
                    x.on_deadline or OnDeadline.ALERT.value, x.state, x.state)
                for x in runs
            ]  # fmt: skip
            found += [
                Due(x.run_id, x.key, float(x.deadline_seconds or 0), _utc(x.deadline_at), x.dag_name, x.tenant,
                    x.on_deadline or OnDeadline.ALERT.value, x.run_state, x.state)
                for x in tasks
            ]  # fmt: skip
            return found

        return self.db.read(read)

    def record(self, item: Due, fence: Fence | None = None) -> DeadlineMiss | None:
        """Record one miss: the compare-and-set of its verdict and its ``deadline_missed``
        event, in one transaction. ``None`` when it was recorded already (another reconciler
        got there first) or is not a miss (any more). With ``fence``: ``None`` too once the run's
        shard moved, after a rejected ledger row naming the stale epoch."""

        def tx(conn: Connection) -> DeadlineMiss | None:
            if fence is not None and (stale := check(conn, fence, item.run_id)) is not None:
                refuse_run(conn, item.run_id, item.state, item.state, f"judging a deadline: {stale}", item.key)
                return None
            stamp = {"deadline_checked_at": db_now(), "deadline_missed_at": db_now()}
            if item.key is None:
                r = t_runs.c
                row = conn.execute(
                    t_runs.update()
                    .where(r.id == item.run_id, *_pending(t_runs), _run_missed())
                    .values(**stamp)
                    .returning(r.state, r.deadline_missed_at)
                ).first()
                attempt, run_state = RUN_EVENT_ATTEMPT, row.state if row is not None else None
                what = "run"
            else:
                t = t_tasks.c
                row = conn.execute(
                    t_tasks.update()
                    .where(t.run_id == item.run_id, t.key == item.key, *_pending(t_tasks), _task_missed())
                    .values(**stamp)
                    .returning(t.state, t.attempt, t.deadline_missed_at)
                ).first()
                attempt = row.attempt if row is not None else 0
                run_state = None
                what = f"task {item.key!r}"
            if row is None:
                return None
            reason = (
                f"deadline missed: {what} deadline {seconds_text(item.deadline_seconds)}s"
                f" (due {iso_utc(item.deadline_at)})"
            )
            if item.state != row.state:  # cancelled (on_deadline=cancel) or ended since it was found
                reason += f"; it was {item.state}"
            if item.on_deadline == OnDeadline.CANCEL.value:
                if run_state is None:
                    run_state = conn.execute(sa.select(t_runs.c.state).where(t_runs.c.id == item.run_id)).scalar()
                reason += f"; on_deadline=cancel: the run is {run_state}"
            self.ledger.annotate(conn, item.run_id, item.key, attempt, row.state, RECONCILER, DEADLINE_MISSED, reason)
            return DeadlineMiss(
                item.run_id, item.key, attempt, item.dag, item.tenant, item.deadline_seconds, item.deadline_at,
                _utc(row.deadline_missed_at), row.state, item.on_deadline, reason,
            )  # fmt: skip

        return self.db.transaction(tx)

    # ------------------------------------------------------------------ reads

    def misses(
        self,
        run_id: str | None = None,
        *,
        tenant: str | None = None,
        since: dt.datetime | None = None,
        limit: int = 1000,
    ) -> list[DeadlineMiss]:
        """Recorded misses, oldest first: of one run, of one tenant, and/or recorded at or after
        ``since``. Read from the ledger rows with ``kind = 'deadline_missed'``."""
        e, r, t = t_events.c, t_runs.c, t_tasks.c
        q = (
            sa.select(
                e.run_id, e.key, e.attempt, e.from_state, e.reason, e.at, r.dag_name, r.tenant, r.on_deadline,
                sa.func.coalesce(t.deadline_seconds, r.deadline_seconds).label("deadline_seconds"),
                sa.func.coalesce(t.deadline_at, r.deadline_at).label("deadline_at"),
            )
            .select_from(
                t_events.join(t_runs, r.id == e.run_id).outerjoin(
                    t_tasks, sa.and_(t.run_id == e.run_id, t.key == e.key)
                )
            )
            .where(e.kind == DEADLINE_MISSED, e.accepted.is_(True))
            .order_by(e.at, e.id)
            .limit(limit)
        )  # fmt: skip
        if run_id is not None:
            q = q.where(e.run_id == run_id)
        if tenant is not None:
            q = q.where(r.tenant == tenant)
        if since is not None:
            q = q.where(e.at >= since)
        return [_miss(x) for x in self.db.read(lambda conn: conn.execute(q).all())]

    def count(self, *, since: dt.datetime | None = None) -> dict[str, int]:
        """How many misses were recorded (at or after ``since``): ``{"run": n, "task": m}``,
        counted from the partial index of annotation events (``ix_orc_task_events_kind``)."""
        e = t_events.c
        q = (
            sa.select(e.key.is_(None).label("run"), sa.func.count())
            .where(e.kind == DEADLINE_MISSED, e.accepted.is_(True))
            .group_by(e.key.is_(None))
        )
        if since is not None:
            q = q.where(e.at >= since)
        counts = {"run": 0, "task": 0}
        for is_run, n in self.db.read(lambda conn: conn.execute(q).all()):
            counts["run" if is_run else "task"] += int(n)
        return counts


def _miss(x: Any) -> DeadlineMiss:
    """A recorded miss from a row of :meth:`Deadlines.misses`."""
    return DeadlineMiss(
        x.run_id, x.key, x.attempt, x.dag_name, x.tenant, float(x.deadline_seconds or 0), _utc(x.deadline_at),
        _utc(x.at), x.from_state, x.on_deadline or OnDeadline.ALERT.value, x.reason or "",
    )  # fmt: skip


def _utc(value: Any) -> dt.datetime:
    moment = aware(value)
    assert moment is not None
    return moment.astimezone(dt.UTC)


def iso_utc(moment: dt.datetime) -> str:
    """``2026-11-23T12:00:00Z`` (milliseconds when the instant has a fraction of a second)."""
    utc = moment.astimezone(dt.UTC)
    text = utc.isoformat(timespec="milliseconds" if utc.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def seconds_text(seconds: float) -> str:
    """``600`` for 600.0, ``0.5`` for 0.5."""
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


__all__ = ["DeadlineMiss", "Deadlines", "Due", "iso_utc", "seconds_text"]
