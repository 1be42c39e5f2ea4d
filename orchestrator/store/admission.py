"""Admission: READY -> QUEUED for as many tasks as live workers can take, in priority order.

The in-flight window of a group of workers consuming the same queues is the sum of their
concurrency (the worker registry, ``workers.py``) times the dispatch depth: each slot has its
running task and up to ``depth - 1`` messages waiting in the broker, so a slot that frees
takes the next message at once instead of waiting for the completion that admits it. The
backlog waits in the database as READY rows. Which QUEUED tasks were really lost is decided
in ``recovery.stale_queued``.

Order: higher priority classes first; within a class the free slots are shared between the
tenants with READY work by weight (``orc_tenants``; a tenant's share is its tasks in flight
on the group's queues over its weight, and the tenant furthest below its share goes next);
within a tenant, older first. A task READY for ``aging`` seconds
(``ORCHESTRATOR_PRIORITY_AGING_SECONDS``) counts one class higher, for twice as long two
classes, so a low backlog is not starved by a stream of high work (``dbtime.aged_rank``; the
same rule in ``orc_admit_from`` on Postgres). The picked task is then checked against the
limits that apply to it (its tenant's, its run's ``max_active_tasks``, its DAG's, its pool's
slots, its rate limit's tokens: ``limits.py``); a held task is set aside with its tenant, run,
pool or rate limit, and the next best one is taken.

On Postgres a completion whose settlement made no task READY does not run this admission: the
server function ``orc_succeed`` hands the slot its worker freed to the best READY task of that
worker's queues (``orc_pass_slot``, migration 0005), without the admission lock, if the
worker's group is under its window. Everything else that changes the READY backlog or the
capacity runs the whole admission: a completion that made tasks READY, a failure, a submit, a
worker registering, the reconciler's pass. SQLite (one writer at a time) always runs it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import schema as s
from ..dbtime import aged_rank, aware, db_after, db_now
from ..models import DISPATCHER, Dispatch
from ..states import TaskState
from . import limits, rows
from .database import Database
from .ledger import Ledger

T = TaskState
t_tasks, t_workers, t_tenants = s.tasks, s.workers, s.tenants


def held_name(why: str, head: Any) -> str:
    """What ``why`` sets aside for the rest of an admission pass: the head's tenant, run, pool or rate limit."""
    return str({"tenant": head.tenant, "run": head.run_id, "pool": head.pool, "rate": head.rate_limit}[why])


#: "never admitted" sorts first among tenants equally far below their share
_NEVER = dt.datetime.min.replace(tzinfo=dt.UTC)
#: picks held back by a limit that one SQLite admission pass looks past at most
HELD_LOOKS = 1000

_ORC_ADMIT = sa.text("SELECT * FROM orc_admit(:window, :ttl, :depth, :wait, :aging)")


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
        the messages to publish *after* the caller commits. On Postgres: the server function
        ``orc_admit`` (migrations 0004, 0005: the same steps, one round trip).

        Admission is serialized (Postgres: an advisory transaction lock). ``wait=False`` (the
        reconciler) skips a pass while another admission holds it; everyone else waits, so the
        work it just made READY is never left for the next tick."""
        if self.db.backend.server_functions:
            params = {"window": window, "ttl": self.worker_ttl, "depth": self.depth, "wait": wait, "aging": self.aging}
            found = conn.execute(_ORC_ADMIT, params).all()
            return [rows.dispatch(r._mapping) for r in sorted(found, key=lambda r: (r.priority_rank, r.ready_at))]
        ready = conn.execute(sa.select(t_tasks.c.run_id).where(t_tasks.c.state == T.READY.value).limit(1)).first()
        if ready is None:
            return []
        groups = self.capacity(conn)
        # count and admit as one step: two dispatchers counting at once would overshoot
        if not groups:  # one writer at a time on SQLite (BEGIN IMMEDIATE): nothing else to lock
            return []
        # the tasks in flight on the live workers' queues (the global window counts those)
        inflight: dict[str, int] = {
            q: n
            for q, n in conn.execute(
                sa.select(t_tasks.c.queue, sa.func.count())
                .where(
                    t_tasks.c.state.in_([T.QUEUED.value, T.RUNNING.value]),
                    t_tasks.c.queue.in_(sorted(set().union(*groups))),
                )
                .group_by(t_tasks.c.queue)
            ).all()
        }
        total = sum(inflight.values())
        # each tenant's (weight, last contested admission, max_running); the picks below update it
        tenants = {
            name: (float(w), last, limit)
            for name, w, last, limit in conn.execute(
                sa.select(t_tenants.c.name, t_tenants.c.weight, t_tenants.c.last_admitted_at, t_tenants.c.max_running)
            ).all()
        }
        admitted: list[Any] = []
        for queues, capacity in groups.items():
            room = min(capacity * self.depth - sum(inflight.get(q, 0) for q in queues), window - total)
            if room <= 0:
                continue
            moved = self._admit_from(conn, sorted(queues), room, tenants)
            for r in moved:
                inflight[r.queue] = inflight.get(r.queue, 0) + 1
            total += len(moved)
            admitted.extend(moved)
        # RETURNING has no order: publish in the order the rows were picked
        admitted.sort(key=lambda r: (r.priority_rank, r.ready_at))
        return [rows.dispatch(r._mapping) for r in admitted]

    def _admit_from(
        self,
        conn: Connection,
        queues: list[str],
        room: int,
        tenants: dict[str, tuple[float, Any, int | None]],
    ) -> list[Any]:
        """Up to ``room`` READY tasks of ``queues`` -> QUEUED, one at a time, each the best head:
        of each tenant's READY tasks in each queue the first (priority, then age); among the
        heads the highest class (with aging), then the tenant furthest below its weighted share
        of the tasks in flight on these queues, then the oldest (``orc_admit_from`` on Postgres).
        A pick that a limit holds back (``limits.held``) is set aside with its run, tenant,
        pool or rate limit, and the next best head is looked at: a held pick uses no room, the
        pass ends when ``room`` tasks moved or no head is left."""
        c = t_tasks.c
        held: dict[str, set[str]] = {"tenant": set(), "run": set(), "pool": set(), "rate": set(), "slots": set()}
        loads: dict[str, int] = {
            tenant: int(n)
            for tenant, n in conn.execute(
                sa.select(c.tenant, sa.func.count())
                .where(c.state.in_([T.QUEUED.value, T.RUNNING.value]), c.queue.in_(queues))
                .group_by(c.tenant)
            ).all()
        }
        moved: list[Any] = []
        # a held pick uses no room, but the looks are bounded: a backlog of tasks too big for
        # their pool's free slots is passed over HELD_LOOKS at a time per pass, not all of it
        looks = 0
        while len(moved) < room and looks < room + HELD_LOOKS:
            looks += 1
            heads = []
            for queue in queues:
                tenant: str | None = None
                while True:
                    q = sa.select(sa.func.min(c.tenant)).where(c.queue == queue, c.state == T.READY.value)
                    if tenant is not None:
                        q = q.where(c.tenant > tenant)
                    tenant = conn.execute(q).scalar()
                    if tenant is None:
                        break
                    if tenant in held["tenant"]:
                        continue
                    head = conn.execute(
                        sa.select(
                            c.run_id, c.key, c.tenant, c.ready_at, c.pool, c.pool_slots, c.rate_limit,
                            aged_rank(c.priority_rank, c.ready_at, self.aging).label("rank"),
                        )
                        .where(
                            c.queue == queue, c.state == T.READY.value, c.tenant == tenant,
                            c.run_id.not_in(held["run"]),
                            (c.run_id + "/" + c.key).not_in(held["slots"]),
                            sa.or_(c.pool.is_(None), c.pool.not_in(held["pool"])),
                            sa.or_(c.rate_limit.is_(None), c.rate_limit.not_in(held["rate"])),
                        )
                        .order_by(c.priority_rank, c.ready_at)
                        .limit(1)
                    ).first()  # fmt: skip
                    if head is not None:
                        heads.append(head)
            if not heads:
                break

            def order(h: Any) -> tuple[Any, ...]:
                weight, last, _ = tenants.get(h.tenant, (1.0, None, None))
                return (h.rank, (loads.get(h.tenant, 0) + 1) / weight, aware(last) or _NEVER, aware(h.ready_at))

            best = min(heads, key=order)
            why = limits.held(conn, best, tenants.get(best.tenant, (1.0, None, None))[2])
            if why is not None:
                held[why].add(f"{best.run_id}/{best.key}" if why == "slots" else held_name(why, best))
                continue
            rows_ = self.ledger.move_many(
                conn,
                (c.run_id == best.run_id, c.key == best.key),
                T.READY,
                T.QUEUED,
                DISPATCHER,
                values={"dispatched_at": db_now()},
                returning=rows.DISPATCH_COLUMNS,
            )
            if not rows_:  # no longer READY (cannot happen with one writer): never pick it again
                held["slots"].add(f"{best.run_id}/{best.key}")
                continue
            moved.extend(rows_)
            if best.rate_limit is not None:
                limits.take_token(conn, best.rate_limit)
            loads[best.tenant] = loads.get(best.tenant, 0) + 1
            if len({h.tenant for h in heads}) > 1:
                # a contested pick: round robin between tenants equally far below their share
                stamp = dt.datetime.now(dt.UTC) + dt.timedelta(microseconds=len(moved))
                weight, _, limit = tenants.get(best.tenant, (1.0, None, None))
                updated = conn.execute(
                    t_tenants.update().where(t_tenants.c.name == best.tenant).values(last_admitted_at=stamp)
                )
                if updated.rowcount == 0:
                    conn.execute(
                        t_tenants.insert().values(
                            name=best.tenant, weight=1.0, updated_at=db_now(), last_admitted_at=stamp
                        )
                    )
                tenants[best.tenant] = (weight, stamp, limit)
        return moved

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
