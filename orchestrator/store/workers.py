"""The worker registry: live workers, the queues they consume, their pool size, the task names
they registered and the code version they advertise. Admission sizes the in-flight window from
it (``admission.py``) and holds a READY task whose name no live worker of its queue registered
(``orc_worker_tasks``). A worker of code version V registers its pinned queues ``Q@V`` among the
queues it consumes (``orchestrator.core.workers``), with its task names: a task of a run pinned
to V is held the same way until a live worker of V that has it registers."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from ..core.models import WORKER
from ..core.states import TaskState
from . import schema as s
from .database import Database
from .dbtime import db_after, db_now
from .ledger import Ledger

t_workers, t_worker_tasks, t_tasks, t_events = s.workers, s.worker_tasks, s.tasks, s.events

#: the task name of a worker that did not say which tasks it has: it takes every name
ANY_TASK = "*"
#: drops of one attempt by workers that lack its task after which it is held even though another
#: live worker of its queue has it (each drop made it READY again for those workers)
MAX_DROPS_BEFORE_HOLD = 3


class WorkerRegistry:
    def __init__(self, db: Database, *, worker_ttl: float) -> None:
        self.db = db
        self.worker_ttl = worker_ttl

    def register(
        self,
        name: str,
        queues: Sequence[str],
        concurrency: int,
        tasks: Collection[str] | None = None,
        *,
        code_version: str | None = None,
    ) -> int:
        """Insert or refresh a live worker's capacity (its pool size on its queues: every queue it
        consumes, its pinned ``Q@VERSION`` ones included), the task names it registered (``None``:
        it does not say, and counts as having every name) and the ``code_version`` it advertises.
        The tasks of its queues that a worker dropped as unregistered and that this one has are
        released to admission; returns how many."""
        names = sorted(set(tasks)) if tasks is not None else [ANY_TASK]

        def tx(conn: Connection) -> int:
            # one statement: two registrations of one name at once (a restart racing its old
            # process's heartbeat) cannot both insert
            row = {
                "queues": sorted(set(queues)), "concurrency": concurrency, "started_at": db_now(), "seen_at": db_now(),
                "code_version": code_version,
            }  # fmt: skip
            upsert = postgresql.insert(t_workers).values(name=name, **row)
            conn.execute(upsert.on_conflict_do_update(index_elements=[t_workers.c.name], set_=row))
            conn.execute(t_worker_tasks.delete().where(t_worker_tasks.c.worker == name))
            pairs = [{"queue": q, "task_name": n, "worker": name} for q in sorted(set(queues)) for n in names]
            if pairs:
                conn.execute(postgresql.insert(t_worker_tasks).on_conflict_do_nothing(), pairs)
            held = [t_tasks.c.dropped_by.is_not(None), t_tasks.c.queue.in_(sorted(set(queues)))]
            if tasks is not None:
                held.append(t_tasks.c.task_name.in_(names))
            return int(conn.execute(t_tasks.update().where(*held).values(dropped_by=None)).rowcount)

        return self.db.transaction(tx)

    def touch(self, name: str, *, code_version: str | None = None) -> bool:
        """Refresh a live worker's row (and the code version it advertises); ``False`` when it has
        to register again: its row is gone, or its task names are (the reconciler's :meth:`prune`
        removed them while it was past the TTL), so that a worker never goes on without its
        names."""
        named = sa.exists().where(t_worker_tasks.c.worker == name)
        values: dict[str, Any] = {"seen_at": db_now()}
        if code_version is not None:
            values["code_version"] = code_version
        with self.db.engine.begin() as conn:
            res = conn.execute(t_workers.update().where(t_workers.c.name == name, named).values(**values))
            return res.rowcount == 1

    def unregister(self, name: str) -> None:
        """A worker is going away: its capacity and names no longer count, and the tasks it
        dropped as unregistered are released to admission (no message can reach it now)."""
        with self.db.engine.begin() as conn:
            conn.execute(t_workers.delete().where(t_workers.c.name == name))
            conn.execute(t_worker_tasks.delete().where(t_worker_tasks.c.worker == name))
            conn.execute(t_tasks.update().where(t_tasks.c.dropped_by == name[:255]).values(dropped_by=None))

    def live(self) -> int:
        """Workers seen within the worker TTL."""
        with self.db.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(t_workers.c.seen_at > db_after(-self.worker_ttl))
                ).scalar_one()
            )

    def prune(self) -> int:
        """The reconciler's pass over the task names: drop those of workers no longer live (their
        registry row gone or past the TTL), release the tasks such a worker dropped as
        unregistered (no message can reach it now: a worker of their queue that has them takes
        them), and give a live worker that wrote none (a release before the names were advertised)
        the name ``*``; returns the rows changed."""
        live = sa.select(t_workers.c.name).where(t_workers.c.seen_at > db_after(-self.worker_ttl))

        def tx(conn: Connection) -> int:
            gone = conn.execute(t_worker_tasks.delete().where(t_worker_tasks.c.worker.not_in(live))).rowcount
            released = conn.execute(
                t_tasks.update()
                .where(t_tasks.c.dropped_by.is_not(None), t_tasks.c.dropped_by.not_in(live))
                .values(dropped_by=None)
            ).rowcount
            silent = (
                sa.select(
                    sa.func.json_array_elements_text(t_workers.c.queues).label("queue"),
                    sa.literal(ANY_TASK).label("task_name"),
                    t_workers.c.name.label("worker"),
                )
                .where(t_workers.c.seen_at > db_after(-self.worker_ttl))
                .where(~sa.exists().where(t_worker_tasks.c.worker == t_workers.c.name))
            )
            added = conn.execute(
                postgresql.insert(t_worker_tasks)
                .from_select(["queue", "task_name", "worker"], silent)
                .on_conflict_do_nothing()
            ).rowcount
            return int(gone) + int(released) + int(added)

        return self.db.transaction(tx)

    def registered(self, conn: Connection, queues: Collection[str]) -> dict[str, dict[str, list[str] | None]]:
        """Per queue of ``queues``: each live worker consuming it -> the task names it registered
        (``None``: every name)."""
        found = conn.execute(
            sa.select(t_worker_tasks.c.queue, t_worker_tasks.c.worker, t_worker_tasks.c.task_name)
            .join(t_workers, t_workers.c.name == t_worker_tasks.c.worker)
            .where(t_worker_tasks.c.queue.in_(sorted(set(queues))), t_workers.c.seen_at > db_after(-self.worker_ttl))
            .order_by(t_worker_tasks.c.queue, t_worker_tasks.c.worker, t_worker_tasks.c.task_name)
        ).all()
        out: dict[str, dict[str, list[str] | None]] = {q: {} for q in queues}
        for queue, worker, task_name in found:
            names = out[queue].setdefault(worker, [])
            if task_name == ANY_TASK:
                out[queue][worker] = None
            elif names is not None:
                names.append(task_name)
        return out

    def versions(self, conn: Connection, queues: Collection[str]) -> dict[str, dict[str, str | None]]:
        """Per queue of ``queues``: each live worker consuming it -> the code version it
        advertises (``None``: it did not say)."""
        found = conn.execute(
            sa.select(t_worker_tasks.c.queue, t_workers.c.name, t_workers.c.code_version)
            .join(t_workers, t_workers.c.name == t_worker_tasks.c.worker)
            .where(t_worker_tasks.c.queue.in_(sorted(set(queues))), t_workers.c.seen_at > db_after(-self.worker_ttl))
            .distinct()
        ).all()
        out: dict[str, dict[str, str | None]] = {q: {} for q in queues}
        for queue, worker, version in found:
            out[queue][worker] = version
        return out

    def drop(self, ledger: Ledger, run_id: str, key: str, attempt: int, worker: str, task_name: str) -> bool:
        """A worker received the attempt's message without ``task_name`` registered and dropped
        it: CAS QUEUED -> READY (same attempt). When another live worker of the task's queue named
        the task among its registered ones (a queue whose workers differ), the task is READY again for them: the
        next admission publishes it, and one of them takes it (a message reaches whichever
        consumer asks first, so the lacking worker may take it again: after
        :data:`MAX_DROPS_BEFORE_HOLD` drops of one attempt the task is held as below). Otherwise
        it is held with ``dropped_by``: admission passes it over until a worker of its queue that
        has the task registers (:meth:`register`) or the worker that dropped it goes away
        (:meth:`unregister`, :meth:`prune`), instead of the reconciler re-publishing it every
        dispatch timeout. Returns whether it moved (a stale or duplicate message's drop is a
        rejected event)."""

        def tx(conn: Connection) -> bool:
            queue = sa.select(t_tasks.c.queue).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
            others = (
                conn.execute(
                    sa.select(t_worker_tasks.c.worker)
                    .join(t_workers, t_workers.c.name == t_worker_tasks.c.worker)
                    .where(
                        t_worker_tasks.c.queue == queue.scalar_subquery(),
                        # named: a worker that did not say which tasks it has ('*') may lack it too
                        t_worker_tasks.c.task_name == task_name,
                        t_worker_tasks.c.worker != worker,
                        t_workers.c.seen_at > db_after(-self.worker_ttl),
                    )
                    .order_by(t_worker_tasks.c.worker)
                    .limit(5)
                )
                .scalars()
                .all()
            )
            drops = conn.execute(
                sa.select(sa.func.count()).where(
                    t_events.c.run_id == run_id,
                    t_events.c.key == key,
                    t_events.c.attempt == attempt,
                    t_events.c.accepted,
                    t_events.c.from_state == TaskState.QUEUED.value,
                    t_events.c.to_state == TaskState.READY.value,
                )
            ).scalar_one()
            if others and drops < MAX_DROPS_BEFORE_HOLD:
                reason = (
                    f"dropped by worker {worker}: task {task_name} is not registered there; READY again for the"
                    f" workers of its queue that have it ({', '.join(others)})"
                )
                values: dict[str, Any] = {"ready_at": db_now()}
            else:
                reason = (
                    f"dropped by worker {worker}: task {task_name} is not registered there; held READY until a"
                    f" worker of its queue that has it registers or {worker} goes away"
                )
                values = {"dropped_by": worker[:255], "ready_at": db_now()}
            moved = ledger.move(
                conn, run_id, key, attempt, TaskState.QUEUED, TaskState.READY, WORKER, reason=reason, values=values
            )
            return bool(moved)

        return self.db.transaction(tx)
