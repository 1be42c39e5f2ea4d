"""Admission: READY -> QUEUED for as many tasks as live workers can take, in priority order.

The in-flight window of a group of workers consuming the same queues is the sum of their
concurrency (the worker registry, ``workers.py``) times the dispatch depth: each slot has its
running task and up to ``depth - 1`` messages waiting in the broker, so a slot that frees
takes the next message at once instead of waiting for the completion that admits it. The
backlog waits in the database as READY rows. Which QUEUED tasks were really lost is decided
in ``recovery.stale_queued``.

Order (``orc_admit_from_v2``): higher priority classes first; within a class the free slots
are shared between the tenants with READY work by weight (``orc_tenants``): a tenant within its
weighted share of the group's window (its tasks in flight on the group's queues) goes before
one above it, and among those the tenant furthest behind in weighted admissions in the group
(start-time fair queueing, ``orc_admission_shares``); within a tenant, older first. A task READY for ``aging`` seconds
(``ORCHESTRATOR_PRIORITY_AGING_SECONDS``) counts one class higher, for twice as long two
classes, so a low backlog is not starved by a stream of high work. The picked task is then
checked against the limits that apply to it (its tenant's, its run's ``max_active_tasks``, its
DAG's, its pool's slots, its rate limit's tokens: ``orc_limit_held_v1``); a held task is set
aside with its tenant, run, pool or rate limit, and the next best one is taken. A READY task whose
task name no live worker of its queue registered (``orc_worker_tasks``, written by the worker
registry, ``workers.py``), or that a worker dropped as unregistered (``dropped_by``), is not
looked at: it waits READY until such a worker registers, and the reconciler's watchdog flags it.
The check is one probe of a small table per task looked at, inside the statement that picks it:
no statement or transaction more per admission (``bench/admission_counts.py``).

A completion whose settlement made no task READY does not run this admission: the server
function ``orc_succeed_v2`` hands its worker group's slots on in batches (``orc_pass_slot_v2``):
nothing while the group has more than one message per slot in flight, then the best READY tasks
of the group's queues up to its window, counted again under its queues' admission locks.
Everything else that changes the READY backlog or the capacity runs the whole
admission: a completion that made tasks READY, a failure, a submit, a worker registering, the
reconciler's pass.

Locks (migration 0036): each queue has its own admission lock (``orc_admission_lock_v1``); a
batch takes its group's, the whole admission those of every live group with READY work, so
groups that share no queue admit without waiting for each other. The single-key lock
``1869767425`` is the cross-group lock of limits and breakers, taken after the queues' locks.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.models import Dispatch
from ..core.states import TaskState
from . import rows
from . import schema as s
from .database import Database
from .dbtime import db_after
from .ledger import Ledger

T = TaskState
t_workers = s.workers


_ORC_ADMIT = sa.text("SELECT * FROM orc_admit_v2(:window, :ttl, :depth, :wait, :aging)")


class Admission:
    def __init__(self, db: Database, ledger: Ledger, *, worker_ttl: float, depth: int, aging: float = 300.0) -> None:
        self.db = db
        self.ledger = ledger
        self.worker_ttl = worker_ttl
        #: messages in flight per live worker slot
        self.depth = depth
        #: seconds READY after which a task counts one priority class higher (0: never)
        self.aging = aging

    def admit(self, conn: Connection, window: int, *, wait: bool = True) -> list[Dispatch]:
        """Admit within capacity (at most ``window`` tasks QUEUED or RUNNING in all); return
        the messages to publish *after* the caller commits: the server function
        ``orc_admit_v2`` (``store/sql/admit.sql``, ``admit_from.sql``), one round trip.

        Admission is serialized per queue (advisory transaction locks of the queues of the
        groups with READY work). ``wait=False`` (the reconciler) skips the groups whose locks
        another admission holds; everyone else waits, so the work it just made READY is never
        left for the next tick."""
        params = {"window": window, "ttl": self.worker_ttl, "depth": self.depth, "wait": wait, "aging": self.aging}
        found = conn.execute(_ORC_ADMIT, params).all()
        # RETURNING has no order: publish in the order the rows were picked
        return [rows.dispatch(r._mapping) for r in sorted(found, key=lambda r: (r.priority_rank, r.ready_at))]

    def capacity(self, conn: Connection) -> dict[frozenset[str], int]:
        """Live workers' concurrency summed per set of consumed queues."""
        groups: dict[frozenset[str], int] = {}
        found = conn.execute(
            sa.select(t_workers.c.queues, t_workers.c.concurrency).where(
                t_workers.c.seen_at > db_after(-self.worker_ttl)
            )
        ).all()
        for queues, concurrency in found:
            key = frozenset(queues)
            groups[key] = groups.get(key, 0) + int(concurrency)
        return groups

    def admit_ready(self, window: int, *, wait: bool = True) -> list[Dispatch]:
        return self.db.transaction(lambda conn: self.admit(conn, window, wait=wait))
