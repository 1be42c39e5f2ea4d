"""What ``orchestrator.web.metrics`` exposes, read in one read-only REPEATABLE READ
transaction with bounded queries (:meth:`MetricsReads.metrics_snapshot`), one named step per
family: open tasks, live workers, due schedules, the ledger window, deadline misses, the
watchdog's flags, the breakers."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...core.models import MetricsSnapshot, OpenTaskCount, ScheduleDue, WindowEvent, WorkerLoad
from ...core.states import DEADLINE_MISSED, NON_TERMINAL, TaskState
from .. import schema as s
from ..dbtime import aware, db_after, db_now
from .base import ReadsBase, as_time, t_events, t_runs, t_tasks, t_workers

#: each breaker's state and its window's counts (metrics)
_BREAKER_COUNTS = sa.text(
    "SELECT k.name, k.mode, k.state, coalesce(sum(c.calls), 0) AS calls, coalesce(sum(c.failures), 0) AS failures"
    " FROM orc_breakers k LEFT JOIN orc_breaker_counts c ON c.name = k.name"
    " AND c.second > now() - make_interval(secs => k.window_seconds)"
    " GROUP BY k.name, k.mode, k.state ORDER BY k.name"
)
#: each breaker's state changes so far, by the state it went to (metrics)
_BREAKER_TRANSITIONS = sa.text(
    "SELECT e.name, e.to_state, count(*) FROM orc_breaker_events e"
    " WHERE e.from_state IS NOT NULL AND e.from_state <> e.to_state GROUP BY e.name, e.to_state"
)

c, e = t_tasks.c, t_events.c


class MetricsReads(ReadsBase):
    """The metrics' one snapshot of the database."""

    def metrics_snapshot(self, *, window_seconds: float, max_events: int, worker_ttl: float) -> MetricsSnapshot:
        """What ``orchestrator.web.metrics`` exposes, read in one read-only REPEATABLE READ
        transaction (one snapshot) with bounded queries:

        - the tasks not yet terminal per (state, queue, tenant), through the state index: as
          many rows as there is open work, never the history of finished tasks;
        - the live workers (seen within ``worker_ttl``) and the tasks RUNNING on each;
        - the active schedules (``ix_orc_schedules_due``);
        - the ledger rows of the last ``window_seconds``, at most the newest ``max_events`` of
          them: a primary-key range below the newest id, each row joined by primary key to its
          run and its task. When the range ends inside the window, ``window_start`` says where.

        Scoped reads keep to their tenant's tasks, ledger rows and schedules, and leave out what
        is the deployment's (the workers, whose slots every tenant's tasks use, and the
        reconciler duty): those are the operator's (an unscoped read).
        """
        tenant = self.tenant
        with self.db.engine.connect() as conn:
            # every query below sees one snapshot
            conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            now = as_time(conn.execute(sa.select(db_now())).scalar_one())
            open_tasks = _open_tasks(conn, tenant)
            # the deployment's, for the operator only
            workers = _worker_loads(conn, worker_ttl) if tenant is None else []
            schedules = _schedules_due(conn, tenant)
            events, window_start = _window(conn, tenant, now, window_seconds, max_events)
            misses = _deadline_misses(conn, tenant, window_seconds)
            stuck = _stuck(conn, tenant)
            on_duty = self.db.backend.reconciler_on_duty(conn) if tenant is None else []
            # deployment-wide, as the breakers are
            breakers, transitions = _breakers(conn) if tenant is None else ([], {})
        return MetricsSnapshot(
            now=now,
            open_tasks=open_tasks,
            workers=workers,
            schedules=schedules,
            events=events,
            window_start=window_start,
            events_read=len(events),
            reconciler_on_duty=on_duty,
            deadline_misses=misses,
            breakers=breakers,
            breaker_transitions=transitions,
            stuck=stuck,
        )


def _open_tasks(conn: Connection, tenant: str | None) -> list[OpenTaskCount]:
    """The tasks not yet terminal per (state, queue, tenant) (the state index serves state IN
    (...)), with the oldest READY task's ``ready_at``."""
    q = (
        sa.select(c.state, c.queue, c.tenant, sa.func.count(), sa.func.min(c.ready_at))
        .where(c.state.in_(sorted(st.value for st in NON_TERMINAL)))
        .group_by(c.state, c.queue, c.tenant)
    )
    if tenant:
        q = q.where(c.tenant == tenant)
    return [
        OpenTaskCount(st, queue, ten, int(n), aware(oldest) if st == TaskState.READY.value else None)
        for st, queue, ten, n, oldest in conn.execute(q).all()
    ]


def _worker_loads(conn: Connection, worker_ttl: float) -> list[WorkerLoad]:
    """The live workers, and the tasks RUNNING on each (``worker`` is ``<hostname>:<pid>``)."""
    w = t_workers.c
    running: dict[str, int] = {}
    for where, n in conn.execute(
        sa.select(c.worker, sa.func.count()).where(c.state == TaskState.RUNNING.value).group_by(c.worker)
    ).all():
        if where:
            host = str(where).rsplit(":", 1)[0]
            running[host] = running.get(host, 0) + int(n)
    return [
        WorkerLoad(name, tuple(queues), int(n), running.get(name, 0), as_time(seen))
        for name, queues, n, seen in conn.execute(
            sa.select(w.name, w.queues, w.concurrency, w.seen_at)
            .where(w.seen_at > db_after(-worker_ttl))
            .order_by(w.name)
        ).all()
    ]


def _schedules_due(conn: Connection, tenant: str | None) -> list[ScheduleDue]:
    """The active schedules and when each fires next (``ix_orc_schedules_due``)."""
    sch = s.schedules.c
    q = sa.select(sch.name, sch.tenant, sch.next_at).where(sch.paused.is_(False)).order_by(sch.name)
    if tenant:
        q = q.where(sch.tenant == tenant)
    return [ScheduleDue(name, ten, as_time(at)) for name, ten, at in conn.execute(q).all()]


def _window(
    conn: Connection, tenant: str | None, now: dt.datetime, window_seconds: float, max_events: int
) -> tuple[list[WindowEvent], dt.datetime]:
    """The window: of the newest ``max_events`` ledger ids, those in the last
    ``window_seconds``, and where the window starts (later than asked when the range ends
    inside it)."""
    window_start = now - dt.timedelta(seconds=window_seconds)
    newest = conn.execute(sa.select(sa.func.max(e.id))).scalar()
    if newest is None:
        return [], window_start
    floor = int(newest) - max(int(max_events), 1)
    q = (
        sa.select(
            e.run_id, e.key, e.attempt, e.from_state, e.to_state, e.actor, e.accepted, e.at, e.reason,
            t_runs.c.tenant, c.queue, c.attempt, c.ready_at, c.started_at, t_runs.c.created_at, e.kind,
        )
        .select_from(
            t_events.outerjoin(t_runs, t_runs.c.id == e.run_id).outerjoin(
                t_tasks, sa.and_(c.run_id == e.run_id, c.key == e.key)
            )
        )
        .where(e.id > floor, e.at >= db_after(-window_seconds))
        .order_by(e.id)
    )  # fmt: skip
    if tenant:
        q = q.where(t_runs.c.tenant == tenant)
    events = [_window_event(r) for r in conn.execute(q).all()]
    if floor > 0:
        # the rows below the range: when they are still inside the window, the range
        # (max_events rows) covers only its newer part
        below = conn.execute(sa.select(e.at).where(e.id <= floor).order_by(e.id.desc()).limit(1)).scalar()
        if below is not None and as_time(below) >= window_start:
            first = conn.execute(sa.select(e.at).where(e.id > floor).order_by(e.id).limit(1)).scalar()
            window_start = as_time(first) if first is not None else now
    return events, window_start


def _window_event(r: Any) -> WindowEvent:
    """A ledger row of the window, with its run's tenant and creation and its task's timings."""
    return WindowEvent(
        r[0], r[1], int(r[2]), r[3], r[4], r[5], bool(r[6]), as_time(r[7]), r[8], r[9] or "",
        queue=r[10], task_attempt=r[11], task_ready_at=aware(r[12]), task_started_at=aware(r[13]),
        run_created_at=aware(r[14]), kind=r[15],
    )  # fmt: skip


def _deadline_misses(conn: Connection, tenant: str | None, window_seconds: float) -> dict[tuple[str, str], int]:
    """Deadline misses of the window by (``run`` or ``task``, tenant), through the partial index
    of annotations (kind, at)."""
    q = (
        sa.select(e.key.is_(None), t_runs.c.tenant, sa.func.count())
        .select_from(t_events.join(t_runs, t_runs.c.id == e.run_id))
        .where(e.kind == DEADLINE_MISSED, e.accepted.is_(True), e.at >= db_after(-window_seconds))
        .group_by(e.key.is_(None), t_runs.c.tenant)
    )
    if tenant:
        q = q.where(t_runs.c.tenant == tenant)
    misses: dict[tuple[str, str], int] = {}
    for is_run, ten, n in conn.execute(q).all():
        scope = ("run" if is_run else "task", str(ten))
        misses[scope] = misses.get(scope, 0) + int(n)
    return misses


def _stuck(conn: Connection, tenant: str | None) -> dict[tuple[str, str], int]:
    """The watchdog's flags by (kind, tenant) (``ix_orc_tasks_stuck``: only flagged tasks)."""
    kind = c.stuck["kind"].astext.label("kind")
    q = sa.select(kind, c.tenant, sa.func.count()).where(c.stuck.is_not(None)).group_by(kind, c.tenant)
    if tenant:
        q = q.where(c.tenant == tenant)
    return {(str(k), str(ten)): int(n) for k, ten, n in conn.execute(q).all()}


def _breakers(
    conn: Connection,
) -> tuple[list[tuple[str, str, str, int, int]], dict[tuple[str, str], int]]:
    """Each breaker's (name, mode, state, calls, failures) in its window, and its state changes
    so far by (name, state it went to)."""
    breakers = [(r.name, r.mode, r.state, int(r.calls), int(r.failures)) for r in conn.execute(_BREAKER_COUNTS).all()]
    transitions: dict[tuple[str, str], int] = {}
    for name, to, n in conn.execute(_BREAKER_TRANSITIONS).all():
        transitions[(str(name), str(to))] = int(n)
    return breakers, transitions
