"""Reads of a run's tasks, edges and ledger: whole (the facade, the kit, the tests) and in
pages by keyset on their primary keys (the web UI, the JSON API). Each is gated: a run these
reads may not see is :class:`RunNotFound`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from ...core.errors import TaskNotFound
from ...core.models import EventView, ProgressView, TaskView
from .. import rows
from .. import schema as s
from ..dbtime import aware
from .base import ReadsBase, t_edges, t_events, t_tasks


@dataclass(frozen=True)
class TaskPage:
    """A page of a run's tasks (:meth:`Reads.task_page`)."""

    tasks: list[TaskView]
    #: whether tasks exist after the page's last key / before its first (with the same filters)
    more_after: bool
    more_before: bool


class TaskReads(ReadsBase):
    """A run's tasks, edges and ledger rows."""

    def get_tasks(self, run_id: str) -> list[TaskView]:
        """The run's tasks; raise :class:`RunNotFound`."""
        q = sa.select(t_tasks).where(t_tasks.c.run_id == run_id).order_by(t_tasks.c.started_at, t_tasks.c.key)
        return [rows.task_view(r) for r in self._of_run(run_id, q)]

    def get_task(self, run_id: str, key: str) -> TaskView:
        """One task; raise :class:`RunNotFound` or :class:`TaskNotFound`."""
        q = sa.select(t_tasks).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
        found = self._of_run(run_id, q)
        row = found[0] if found else None
        if row is None:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return rows.task_view(row)

    def progress(
        self, run_id: str, keys: Sequence[str] | None = None, *, running: bool = False, limit: int | None = None
    ) -> dict[str, ProgressView]:
        """The latest progress of the run's tasks (of ``keys`` when given; only those RUNNING with
        ``running``; the ``limit`` freshest), each only while the task holds the attempt that
        reported it, by key; raise :class:`RunNotFound`."""
        p, t = s.progress.c, t_tasks.c
        q = (
            sa.select(p.key, p.attempt, p.state, p.meta, p.updated_at)
            .join(t_tasks, sa.and_(t.run_id == p.run_id, t.key == p.key, t.attempt == p.attempt))
            .where(p.run_id == run_id)
            .order_by(p.updated_at.desc())
        )
        if keys is not None:
            if not keys:
                return {}
            q = q.where(p.key.in_(sorted(set(keys))))
        if running:
            q = q.where(t.state == "RUNNING")
        if limit is not None:
            q = q.limit(limit)
        return {
            r.key: ProgressView(r.key, r.attempt, r.state, r.meta, aware(r.updated_at))  # type: ignore[arg-type]
            for r in self._of_run(run_id, q)
        }

    def attempt_outcome(self, run_id: str, key: str, attempt: int) -> tuple[str, str | None]:
        """The state one attempt of a task ended in (its last accepted ledger row's, with its
        reason), or ``("PENDING", None)`` when the ledger has none; raise :class:`RunNotFound`."""
        e = t_events.c
        q = (
            sa.select(e.to_state, e.reason)
            .where(e.run_id == run_id, e.key == key, e.attempt == attempt, e.accepted)
            .order_by(e.id.desc())
            .limit(1)
        )
        found = self._of_run(run_id, q)
        return (found[0].to_state, found[0].reason) if found else ("PENDING", None)

    def events(self, run_id: str, *, newest: int | None = None) -> list[EventView]:
        """The run's ledger, oldest first: task events and the run's own (``key`` None);
        only the ``newest`` rows when given (live views). Raise :class:`RunNotFound`."""
        q = sa.select(t_events).where(t_events.c.run_id == run_id)
        if newest is not None:
            inner = q.order_by(t_events.c.id.desc()).limit(newest).subquery()
            q = sa.select(inner).order_by(inner.c.id)
        else:
            q = q.order_by(t_events.c.id)
        return [rows.event_view(r) for r in self._of_run(run_id, q)]

    def edges(self, run_id: str) -> list[tuple[str, str]]:
        """The run's dependency edges as (parent key, child key), in a stable order; raise
        :class:`RunNotFound`."""
        q = (
            sa.select(t_edges.c.parent_key, t_edges.c.child_key)
            .where(t_edges.c.run_id == run_id)
            .order_by(t_edges.c.parent_key, t_edges.c.child_key)
        )
        return [(p, c) for p, c in self._of_run(run_id, q)]

    # ------------------------------------------------------------------ paged reads (the web UI, the JSON API)

    def task_page(
        self,
        run_id: str,
        *,
        limit: int,
        after: str | None = None,
        before: str | None = None,
        state: str | None = None,
        search: str | None = None,
    ) -> TaskPage:
        """One page of the run's tasks in key order (keyset paging on the primary key
        ``(run_id, key)``): the first ``limit`` keys after ``after``, or the last ``limit`` before
        ``before``; only those in ``state`` and/or whose key contains ``search`` (case
        insensitive). ``more_after`` / ``more_before`` say whether a further page exists on
        either side. Raise :class:`RunNotFound`."""
        c = t_tasks.c
        where = [c.run_id == run_id]
        if state:
            where.append(c.state == state)
        if search:
            escaped = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append(c.key.ilike(f"%{escaped}%", escape="\\"))
        backwards = before is not None and after is None
        if after is not None:
            where.append(c.key > after)
        if before is not None and after is None:
            where.append(c.key < before)
        q = sa.select(t_tasks).where(*where).order_by(c.key.desc() if backwards else c.key).limit(limit + 1)
        found = self._of_run(run_id, q)
        more = len(found) > limit
        found = list(found[:limit])
        if backwards:
            found.reverse()
        return TaskPage(
            tasks=[rows.task_view(r) for r in found],
            more_after=more if not backwards else True,
            more_before=(after is not None) if not backwards else more,
        )

    def keys_in_states(self, run_id: str, states: Sequence[str]) -> list[tuple[str, str]]:
        """(key, state) of the run's tasks in ``states``, in key order: two plain columns (a bulk
        retry reads a run's FAILED and DEAD_LETTER tasks so, not as views); raise :class:`RunNotFound`."""
        q = (
            sa.select(t_tasks.c.key, t_tasks.c.state)
            .where(t_tasks.c.run_id == run_id, t_tasks.c.state.in_(list(states)))
            .order_by(t_tasks.c.key)
        )
        return [(str(k), str(st)) for k, st in self._of_run(run_id, q)]

    def tasks_by_key(self, run_id: str, keys: Sequence[str]) -> list[TaskView]:
        """The run's tasks of ``keys`` (by primary key), in key order; raise :class:`RunNotFound`."""
        q = (
            sa.select(t_tasks)
            .where(t_tasks.c.run_id == run_id, t_tasks.c.key.in_(sorted(set(keys))))
            .order_by(t_tasks.c.key)
        )
        return [rows.task_view(r) for r in self._of_run(run_id, q)] if keys else []

    def edge_page(
        self, run_id: str, *, limit: int, after: tuple[str, str] | None = None
    ) -> tuple[list[tuple[str, str]], bool]:
        """``limit`` of the run's edges in (parent, child) order after the edge ``after`` (keyset
        on the primary key), and whether more follow; raise :class:`RunNotFound`."""
        e = t_edges.c
        where = [e.run_id == run_id]
        if after is not None:
            where.append(sa.tuple_(e.parent_key, e.child_key) > sa.tuple_(sa.literal(after[0]), sa.literal(after[1])))
        q = sa.select(e.parent_key, e.child_key).where(*where).order_by(e.parent_key, e.child_key).limit(limit + 1)
        found = [(p, c) for p, c in self._of_run(run_id, q)]
        return found[:limit], len(found) > limit

    def event_page(
        self, run_id: str, *, limit: int, after: int | None = None, before: int | None = None
    ) -> tuple[list[tuple[int, EventView]], bool]:
        """``limit`` ledger rows of the run as ``(id, event)``, oldest first, and whether more
        exist beyond them: the first ones after the id ``after`` (what changed since), else the
        newest ones before the id ``before`` (or the newest of all). The primary key on ``id``
        bounds both ranges. Raise :class:`RunNotFound`."""
        e = t_events.c
        where = [e.run_id == run_id]
        if after is not None:
            where.append(e.id > after)
            q = sa.select(t_events).where(*where).order_by(e.id).limit(limit + 1)
        else:
            if before is not None:
                where.append(e.id < before)
            q = sa.select(t_events).where(*where).order_by(e.id.desc()).limit(limit + 1)
        found = list(self._of_run(run_id, q))
        more = len(found) > limit
        found = found[:limit]
        if after is None:
            found.reverse()
        return [(int(r.id), rows.event_view(r)) for r in found], more
