"""Reads: runs, tasks and the ledger as domain values, and the raw rows the invariant
checker and the chaos soak inspect.

A :class:`Reads` may be scoped to a tenant (:meth:`Reads.scoped`, what an orchestrator bound to
a tenant reads through): then every read of one run is gated in its own query (``WHERE id = :run
AND tenant = :tenant``), so a run of another tenant is :class:`RunNotFound` exactly like a run
that does not exist, whoever the caller is and whatever it remembers; the runs list, the metrics
and explain keep to the tenant's rows.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.errors import RunNotFound, TaskNotFound
from ..core.explain import ExplainInput, LimitUse
from ..core.models import (
    EventView,
    MetricsSnapshot,
    OpenTaskCount,
    RateLimit,
    RunView,
    ScheduleDue,
    TaskView,
    WindowEvent,
    WorkerLoad,
)
from ..core.states import DEADLINE_MISSED, NON_TERMINAL, RunState, TaskState
from . import rows
from . import schema as s
from .breakers import breaker_row
from .database import Database
from .dbtime import aware, db_after, db_now
from .limits import bucket
from .probes import probe_effects
from .workers import WorkerRegistry

t_tasks, t_runs, t_edges, t_events, t_workers = s.tasks, s.runs, s.edges, s.events, s.workers


@dataclass(frozen=True)
class Snapshot:
    """Everything the database holds about some runs (see ``invariants.check_runs``)."""

    runs: list[Any]
    tasks: list[Any]
    events: list[Any]
    edges: list[Any]
    #: (run, key, attempt, executions) from the probe effects, when recorded
    effects: list[Any]
    #: task id (``<run>.<key>.<attempt>``) -> times its message was delivered again
    redeliveries: dict[str, int]


@dataclass(frozen=True)
class TaskPage:
    """A page of a run's tasks (:meth:`Reads.task_page`)."""

    tasks: list[TaskView]
    #: whether tasks exist after the page's last key / before its first (with the same filters)
    more_after: bool
    more_before: bool


#: the columns of ``orc_runs`` a :class:`RunView` needs: not the DAG's snapshot (a 50,000-task
#: run's is megabytes of JSON, decoded for nothing by every run page and runs list)
RUN_VIEW_COLUMNS = [c for c in t_runs.c if c.name != "dag_snapshot"]


class Reads:
    def __init__(self, db: Database, *, tenant: str | None = None) -> None:
        self.db = db
        #: the tenant these reads see (``None``: every tenant, the deployment's operator)
        self.tenant = tenant

    def scoped(self, tenant: str | None) -> Reads:
        """These reads as ``tenant`` sees them (``None``: every tenant)."""
        return self if tenant == self.tenant else Reads(self.db, tenant=tenant)

    def _run_where(self, run_id: str) -> list[Any]:
        """The condition on ``orc_runs`` of a run these reads may see."""
        where = [t_runs.c.id == run_id]
        if self.tenant is not None:
            where.append(t_runs.c.tenant == self.tenant)
        return where

    def _own_tasks(self) -> list[Any]:
        """The condition on ``orc_tasks`` of the tasks these reads may see."""
        return [] if self.tenant is None else [t_tasks.c.tenant == self.tenant]

    def _gate(self, conn: Any, run_id: str) -> None:
        """Raise :class:`RunNotFound` unless the run exists and these reads may see it."""
        if conn.execute(sa.select(t_runs.c.id).where(*self._run_where(run_id))).first() is None:
            raise RunNotFound(f"no run with id {run_id!r}")

    def get_run(self, run_id: str) -> RunView:
        """The run with per-state task counts; raise :class:`RunNotFound`. Like every read here,
        it rides out a database restart within the store's ``retry_seconds``."""

        def read(conn: Any) -> tuple[Any, dict[str, int]]:
            row = conn.execute(sa.select(*RUN_VIEW_COLUMNS).where(*self._run_where(run_id))).first()
            return row, (self._counts(conn, [run_id]).get(run_id, {}) if row is not None else {})

        row, counts = self.db.read(read)
        if row is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return rows.run_view(row, counts)

    def run_state(self, run_id: str) -> RunState:
        query = sa.select(t_runs.c.state).where(*self._run_where(run_id))
        state = self.db.read(lambda conn: conn.execute(query).scalar_one_or_none())
        if state is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return RunState(state)

    def list_runs(
        self,
        limit: int = 20,
        *,
        tenant: str | None = None,
        dag: str | None = None,
        state: RunState | None = None,
        offset: int = 0,
        dag_version: int | None = None,
    ) -> list[RunView]:
        """The newest runs with their per-state task counts (so ``needs_attention`` is true),
        optionally of one tenant, DAG or run state; ``offset`` pages further back. Scoped reads
        list their tenant's runs only (another ``tenant``: none)."""
        if self.tenant is not None:
            if tenant not in (None, self.tenant):
                return []
            tenant = self.tenant
        q = (
            sa.select(*RUN_VIEW_COLUMNS)
            .order_by(t_runs.c.created_at.desc(), t_runs.c.id.desc())
            .limit(limit)
            .offset(offset)
        )
        if tenant:
            q = q.where(t_runs.c.tenant == tenant)
        if dag:
            q = q.where(t_runs.c.dag_name == dag)
        if dag_version is not None:
            q = q.where(t_runs.c.dag_version == dag_version)
        if state is not None:
            q = q.where(t_runs.c.state == state.value)

        def read(conn: Any) -> tuple[Any, dict[str, dict[str, int]]]:
            found = conn.execute(q).all()
            return found, self._counts(conn, [r.id for r in found])

        found, counts = self.db.read(read)
        return [rows.run_view(r, counts.get(r.id, {})) for r in found]

    @staticmethod
    def _counts(conn: Any, run_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        if not run_ids:
            return {}
        out: dict[str, dict[str, int]] = {}
        for run_id, state, n in conn.execute(
            sa.select(t_tasks.c.run_id, t_tasks.c.state, sa.func.count())
            .where(t_tasks.c.run_id.in_(list(run_ids)))
            .group_by(t_tasks.c.run_id, t_tasks.c.state)
        ).all():
            out.setdefault(run_id, {})[state] = int(n)
        return out

    def _of_run(self, run_id: str, query: Any) -> Any:
        """Rows of one run these reads may see (:class:`RunNotFound` otherwise), in one connection."""

        def read(conn: Any) -> Any:
            self._gate(conn, run_id)
            return conn.execute(query).all()

        return self.db.read(read)

    def get_tasks(self, run_id: str) -> list[TaskView]:
        """The run's tasks; raise :class:`RunNotFound`."""
        q = sa.select(t_tasks).where(t_tasks.c.run_id == run_id).order_by(t_tasks.c.started_at, t_tasks.c.key)
        return [rows.task_view(r) for r in self._of_run(run_id, q)]

    def rerun_source(self, run_id: str) -> Any:
        """The run's DAG snapshot (with its params) and tenant, to run it again; raise
        :class:`RunNotFound`."""
        q = sa.select(t_runs.c.dag_snapshot.label("snapshot"), t_runs.c.tenant, t_runs.c.dag_version).where(
            *self._run_where(run_id)
        )
        with self.db.engine.connect() as conn:
            row = conn.execute(q).first()
        if row is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return row

    def get_task(self, run_id: str, key: str) -> TaskView:
        """One task; raise :class:`RunNotFound` or :class:`TaskNotFound`."""
        q = sa.select(t_tasks).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
        found = self._of_run(run_id, q)
        row = found[0] if found else None
        if row is None:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return rows.task_view(row)

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

    def _plain(self, run_id: str, sql: str) -> list[tuple[Any, ...]]:
        """Many rows of a few plain columns of one run (``%(run)s`` in ``sql``), gated like every
        read here, through the driver's cursor: a third of the cost of SQLAlchemy's rows, which
        counts for a run of 50,000 tasks."""

        def read(conn: Any) -> list[tuple[Any, ...]]:
            self._gate(conn, run_id)
            with conn.connection.driver_connection.cursor() as cur:
                cur.execute(sql, {"run": run_id})
                return list(cur.fetchall())

        found: list[tuple[Any, ...]] = self.db.read(read)
        return found

    def drawing_rows(self, run_id: str) -> list[tuple[Any, ...]]:
        """What the DAG drawing needs of every task of the run, and nothing more:
        ``(key, task name, state, trigger rule, attempt)``; raise :class:`RunNotFound`."""
        return self._plain(
            run_id,
            f"SELECT key, task_name, state, trigger_rule, attempt FROM {t_tasks.name} WHERE run_id = %(run)s",
        )

    def edge_list(self, run_id: str) -> list[tuple[Any, ...]]:
        """The run's edges ``(parent key, child key)`` in no set order (the drawing's skeleton);
        raise :class:`RunNotFound`."""
        return self._plain(run_id, f"SELECT parent_key, child_key FROM {t_edges.name} WHERE run_id = %(run)s")

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

    def edges(self, run_id: str) -> list[tuple[str, str]]:
        """The run's dependency edges as (parent key, child key), in a stable order; raise
        :class:`RunNotFound`."""
        q = (
            sa.select(t_edges.c.parent_key, t_edges.c.child_key)
            .where(t_edges.c.run_id == run_id)
            .order_by(t_edges.c.parent_key, t_edges.c.child_key)
        )
        return [(p, c) for p, c in self._of_run(run_id, q)]

    def logical_date(self, run_id: str) -> str | None:
        """The run's logical date (ISO 8601), or ``None``."""
        query = sa.select(t_runs.c.logical_date).where(*self._run_where(run_id))
        found: str | None = self.db.read(lambda conn: conn.execute(query).scalar())
        return found

    def explain_input(
        self, run_id: str, *, worker_ttl: float, depth: int, keys: Collection[str] | None = None
    ) -> ExplainInput:
        """What ``explain`` needs about a run, read in one connection (raise :class:`RunNotFound`).
        With ``keys``, only what explaining those tasks needs: them, their edges in and their
        parents (a page of a 50,000-task run reads a few hundred rows, not the run), the child
        of the map before that holds a chained map child's item, and the ledger rows that
        decided them (out of PENDING, or into SKIPPED)."""
        c = t_tasks.c
        with self.db.engine.connect() as conn:
            found_run = conn.execute(
                sa.select(t_runs.c.state, t_runs.c.tenant, t_runs.c.dag_name, t_runs.c.max_active_tasks).where(
                    *self._run_where(run_id)
                )
            ).first()
            if found_run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            run_state, tenant, dag_name, max_active = found_run
            edge_where = [t_edges.c.run_id == run_id]
            task_where = [c.run_id == run_id]
            if keys is not None:
                wanted = sorted(set(keys))
                edge_where.append(t_edges.c.child_key.in_(wanted))
                parents = conn.execute(sa.select(t_edges.c.parent_key).where(*edge_where)).scalars().all()
                item_where = (c.run_id == run_id, c.key.in_(wanted), c.map_item_from.is_not(None))
                items = conn.execute(sa.select(c.map_item_from).where(*item_where)).scalars().all()
                task_where.append(c.key.in_(sorted(set(wanted) | set(parents) | set(items))))
            tasks = conn.execute(
                sa.select(
                    c.key, c.state, c.attempt, c.max_attempts, c.trigger_rule, c.n_upstream, c.n_done,
                    c.n_succeeded, c.n_failed, c.n_skipped, c.queue, c.priority, c.not_before,
                    c.dispatched_at, c.worker, c.lease_expires_at, c.pool, c.pool_slots, c.rate_limit,
                    c.resources,
                    # dynamic DAGs: skips, the counters of the new rules, maps
                    c.skip_reason, c.n_upstream_failed, c.n_setup, c.n_setup_ok, c.n_setup_skipped,
                    c.min_success_ratio, c.map_spec.is_not(None).label("is_map"), c.map_parent, c.map_index,
                    c.map_key, c.map_item_from, c.map_total, c.map_done, c.map_ok, c.map_failed, c.map_skipped,
                    c.waiting,
                    # the watchdog: the task name (is it registered?), a worker's drop, the flag
                    c.task_name, c.dropped_by, c.stuck,
                )
                .where(*task_where)
                .order_by(c.key)
            ).all()  # fmt: skip
            e = t_events.c
            decided = [e.run_id == run_id, e.accepted.is_(True), e.kind.is_(None), e.key.is_not(None)]
            decided.append(sa.or_(e.from_state == "PENDING", e.to_state == "SKIPPED"))
            if keys is not None:
                decided.append(e.key.in_(sorted(set(keys))))
            ledger: dict[str, dict[str, dict[str, Any]]] = {}
            for ev in conn.execute(sa.select(e.key, e.from_state, e.to_state, e.reason).where(*decided).order_by(e.id)):
                entry = {"from": ev.from_state, "to": ev.to_state, "reason": ev.reason}
                ledger.setdefault(ev.key, {})[ev.to_state] = entry
                if ev.from_state == "PENDING":
                    ledger[ev.key]["decided"] = entry
            edges = [
                (p, ch)
                for p, ch in conn.execute(sa.select(t_edges.c.parent_key, t_edges.c.child_key).where(*edge_where)).all()
            ]
            workers = [
                (list(queues), int(n))
                for queues, n in conn.execute(
                    sa.select(t_workers.c.queues, t_workers.c.concurrency).where(
                        t_workers.c.seen_at > db_after(-worker_ttl)
                    )
                ).all()
            ]
            # READY tasks ahead of each of the run's READY tasks: in every queue that the live
            # workers consuming its queue also take, by priority, then age (admission's order)
            ahead: dict[str, int] = {}
            groups = [set(queues) for queues, _ in workers]
            for queue in sorted({t.queue for t in tasks if t.state == "READY"}):
                scope = set().union(*(g for g in groups if queue in g)) or {queue}
                ordered = conn.execute(
                    sa.select(c.run_id, c.key, c.queue)
                    .where(c.state == "READY", c.queue.in_(sorted(scope)))
                    .order_by(c.priority_rank, c.ready_at, c.run_id, c.key)
                ).all()
                for position, row in enumerate(ordered):
                    if row.run_id == run_id and row.queue == queue:
                        ahead[row.key] = position
            in_flight = {
                q: int(n)
                for q, n in conn.execute(
                    sa.select(c.queue, sa.func.count()).where(c.state.in_(["QUEUED", "RUNNING"])).group_by(c.queue)
                ).all()
            }
            now = conn.execute(sa.select(db_now())).scalar_one()
            ready = [t for t in tasks if t.state == "READY"]
            limits = _limit_uses(conn, run_id, str(tenant), str(dag_name), max_active, ready, now) if ready else {}
            if ready:
                scopes = {q: set().union(*(g for g in groups if q in g)) or {q} for q in {t.queue for t in ready}}
                limits.update(_shares(conn, str(tenant), scopes))
            if self.tenant is not None:
                limits = _veiled(limits, str(tenant), {r.run_id for r in _flying_of(conn, self.tenant)})
            registered = WorkerRegistry(self.db, worker_ttl=worker_ttl).registered(conn, {t.queue for t in ready})
        return ExplainInput(
            run_state, tasks, edges, workers, ahead, in_flight, depth, now, tenant=str(tenant), dag=str(dag_name),
            ledger=ledger, registered=registered, **limits,
        )  # fmt: skip

    # ------------------------------------------------------------------ diagnostics

    def _visible_ids(self, conn: Any, run_ids: Sequence[str]) -> list[str]:
        """The runs of ``run_ids`` these reads may see (a bound caller: its tenant's only)."""
        ids = list(run_ids)
        if self.tenant is None or not ids:
            return ids
        return list(
            conn.execute(sa.select(t_runs.c.id).where(t_runs.c.id.in_(ids), t_runs.c.tenant == self.tenant)).scalars()
        )

    def snapshot(self, run_ids: Sequence[str]) -> Snapshot:
        with self.db.engine.connect() as conn:
            ids = self._visible_ids(conn, run_ids)
            effects: list[Any] = []
            if sa.inspect(conn).has_table(probe_effects.name):
                e = probe_effects.c
                effects = list(
                    conn.execute(
                        sa.select(e.run_id, e.key, e.attempt, sa.func.count())
                        .where(e.run_id.in_(ids))
                        .group_by(e.run_id, e.key, e.attempt)
                    ).all()
                )
            return Snapshot(
                runs=list(conn.execute(sa.select(t_runs.c.id, t_runs.c.state).where(t_runs.c.id.in_(ids))).all()),
                tasks=list(conn.execute(sa.select(t_tasks).where(t_tasks.c.run_id.in_(ids))).all()),
                events=list(
                    conn.execute(sa.select(t_events).where(t_events.c.run_id.in_(ids)).order_by(t_events.c.id)).all()
                ),
                edges=list(conn.execute(sa.select(t_edges).where(t_edges.c.run_id.in_(ids))).all()),
                effects=effects,
                redeliveries=self._redeliveries(conn, ids),
            )

    def _redeliveries(self, conn: Connection, run_ids: Sequence[str]) -> dict[str, int]:
        # a message id is its task id, ``<run>.<key>.<attempt>``: one query for every run
        d = s.deliveries.c
        found = conn.execute(
            sa.select(d.message_id, d.deliveries).where(sa.func.split_part(d.message_id, ".", 1).in_(list(run_ids)))
        ).all()
        return {m: int(n) - 1 for m, n in found}

    def finished_runs(self, run_ids: Sequence[str]) -> int:
        """How many of ``run_ids`` are in a final state."""
        if not run_ids:
            return 0
        with self.db.engine.connect() as conn:
            run_ids = self._visible_ids(conn, run_ids)
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(
                        t_runs.c.id.in_(list(run_ids)), t_runs.c.state != RunState.RUNNING.value
                    )
                ).scalar_one()
            )

    def task_states(self, run_ids: Sequence[str]) -> dict[str, int]:
        with self.db.engine.connect() as conn:
            run_ids = self._visible_ids(conn, run_ids)
            found = conn.execute(
                sa.select(t_tasks.c.state, sa.func.count())
                .where(t_tasks.c.run_id.in_(list(run_ids)))
                .group_by(t_tasks.c.state)
            ).all()
        return {st: int(n) for st, n in found}

    def rejected_events(self, run_ids: Sequence[str]) -> int:
        with self.db.engine.connect() as conn:
            run_ids = self._visible_ids(conn, run_ids)
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(
                        t_events.c.run_id.in_(list(run_ids)), t_events.c.accepted.is_(False)
                    )
                ).scalar_one()
            )

    def reconciler_on_duty(self) -> list[str]:
        """Which reconciler holds the duty (``orchestrator-reconciler:<name>``); empty when
        none does."""
        with self.db.engine.connect() as conn:
            return self.db.backend.reconciler_on_duty(conn)

    def in_flight(self, limit: int = 1) -> list[Any]:
        """QUEUED or RUNNING tasks: (run_id, key, attempt, task_name, queue)."""
        with self.db.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.task_name, t_tasks.c.queue)
                    .where(t_tasks.c.state.in_(["QUEUED", "RUNNING"]), *self._own_tasks())
                    .limit(limit)
                ).all()
            )

    # ------------------------------------------------------------------ metrics

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
        c, e, w, sch = t_tasks.c, t_events.c, t_workers.c, s.schedules.c
        tenant = self.tenant
        with self.db.engine.connect() as conn:
            # every query below sees one snapshot
            conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            now = _as_time(conn.execute(sa.select(db_now())).scalar_one())
            # tasks not yet terminal (the state index serves state IN (...))
            q = (
                sa.select(c.state, c.queue, c.tenant, sa.func.count(), sa.func.min(c.ready_at))
                .where(c.state.in_(sorted(st.value for st in NON_TERMINAL)))
                .group_by(c.state, c.queue, c.tenant)
            )
            if tenant:
                q = q.where(c.tenant == tenant)
            open_tasks = [
                OpenTaskCount(st, queue, ten, int(n), aware(oldest) if st == TaskState.READY.value else None)
                for st, queue, ten, n, oldest in conn.execute(q).all()
            ]
            # live workers, and the tasks RUNNING on each (``worker`` is ``<hostname>:<pid>``):
            # the deployment's, for the operator only
            workers: list[WorkerLoad] = []
            if tenant is None:
                running: dict[str, int] = {}
                for where, n in conn.execute(
                    sa.select(c.worker, sa.func.count()).where(c.state == TaskState.RUNNING.value).group_by(c.worker)
                ).all():
                    if where:
                        host = str(where).rsplit(":", 1)[0]
                        running[host] = running.get(host, 0) + int(n)
                workers = [
                    WorkerLoad(name, tuple(queues), int(n), running.get(name, 0), _as_time(seen))
                    for name, queues, n, seen in conn.execute(
                        sa.select(w.name, w.queues, w.concurrency, w.seen_at)
                        .where(w.seen_at > db_after(-worker_ttl))
                        .order_by(w.name)
                    ).all()
                ]
            q = sa.select(sch.name, sch.tenant, sch.next_at).where(sch.paused.is_(False)).order_by(sch.name)
            if tenant:
                q = q.where(sch.tenant == tenant)
            schedules = [ScheduleDue(name, ten, _as_time(at)) for name, ten, at in conn.execute(q).all()]
            # the window: the newest ``max_events`` ledger ids, of which those in the last window_seconds
            window_start = now - dt.timedelta(seconds=window_seconds)
            events: list[WindowEvent] = []
            newest = conn.execute(sa.select(sa.func.max(e.id))).scalar()
            if newest is not None:
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
                events = [
                    WindowEvent(
                        r[0], r[1], int(r[2]), r[3], r[4], r[5], bool(r[6]), _as_time(r[7]), r[8], r[9] or "",
                        queue=r[10], task_attempt=r[11], task_ready_at=aware(r[12]), task_started_at=aware(r[13]),
                        run_created_at=aware(r[14]), kind=r[15],
                    )
                    for r in conn.execute(q).all()
                ]  # fmt: skip
                if floor > 0:
                    # the rows below the range: when they are still inside the window, the range
                    # (max_events rows) covers only its newer part
                    below = conn.execute(sa.select(e.at).where(e.id <= floor).order_by(e.id.desc()).limit(1)).scalar()
                    if below is not None and _as_time(below) >= window_start:
                        first = conn.execute(sa.select(e.at).where(e.id > floor).order_by(e.id).limit(1)).scalar()
                        window_start = _as_time(first) if first is not None else now
            # deadline misses of the window, through the partial index of annotations (kind, at)
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
            # the watchdog's flags, by kind (``ix_orc_tasks_stuck``: only flagged tasks)
            kind = c.stuck["kind"].astext.label("kind")
            q = sa.select(kind, c.tenant, sa.func.count()).where(c.stuck.is_not(None)).group_by(kind, c.tenant)
            if tenant:
                q = q.where(c.tenant == tenant)
            stuck = {(str(kind), str(ten)): int(n) for kind, ten, n in conn.execute(q).all()}
            on_duty = self.db.backend.reconciler_on_duty(conn) if tenant is None else []
            breakers: list[tuple[str, str, str, int, int]] = []
            transitions: dict[tuple[str, str], int] = {}
            if tenant is None:  # deployment-wide, as the breakers are
                for r in conn.execute(_BREAKER_COUNTS).all():
                    breakers.append((r.name, r.mode, r.state, int(r.calls), int(r.failures)))
                for name, to, n in conn.execute(_BREAKER_TRANSITIONS).all():
                    transitions[(str(name), str(to))] = int(n)
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


def _limit_uses(
    conn: Connection, run_id: str, tenant: str, dag: str, max_active: int | None, ready: Sequence[Any], now: Any
) -> dict[str, Any]:
    """The limits that apply to a run's READY tasks and who holds them: from the tasks in flight
    of the whole deployment (bounded by the workers' window), as admission counts them."""
    c = t_tasks.c
    flying = conn.execute(
        sa.select(c.run_id, c.key, c.tenant, c.pool, c.pool_slots, t_runs.c.dag_name)
        .join(t_runs, t_runs.c.id == c.run_id)
        .where(c.state.in_(["QUEUED", "RUNNING"]))
    ).all()

    def use(limit: int, rows: Sequence[Any]) -> LimitUse:
        holders: dict[str, int] = {}
        for r in rows:
            holders[r.run_id] = holders.get(r.run_id, 0) + 1
        return LimitUse(int(limit), len(rows), holders)

    out: dict[str, Any] = {}
    tenant_max = conn.execute(sa.select(s.tenants.c.max_running).where(s.tenants.c.name == tenant)).scalar()
    if tenant_max is not None:
        out["tenant_limit"] = use(tenant_max, [r for r in flying if r.tenant == tenant])
    if max_active is not None:
        out["run_limit"] = use(max_active, [r for r in flying if r.run_id == run_id])
    dag_max = conn.execute(
        sa.select(s.dag_limits.c.max_running).where(s.dag_limits.c.tenant == tenant, s.dag_limits.c.dag_name == dag)
    ).scalar()
    if dag_max is not None:
        out["dag_limit"] = use(dag_max, [r for r in flying if r.tenant == tenant and r.dag_name == dag])
    pool_names = sorted({t.pool for t in ready if t.pool is not None})
    if pool_names:
        slots = dict(
            conn.execute(sa.select(s.pools.c.name, s.pools.c.slots).where(s.pools.c.name.in_(pool_names))).all()
        )
        pools: dict[str, LimitUse | None] = {}
        for name in pool_names:
            if name not in slots:
                pools[name] = None
                continue
            holders = {f"{r.run_id}/{r.key}": int(r.pool_slots) for r in flying if r.pool == name}
            pools[name] = LimitUse(int(slots[name]), sum(holders.values()), holders)
        out["pools"] = pools
    resources = sorted({r for t in ready for r in (getattr(t, "resources", None) or ())})
    if resources:
        # the breakers that hold their resource's tasks now, in words (``explain``: held: ...)
        rows = conn.execute(sa.select(s.breakers).where(s.breakers.c.name.in_(resources))).all()
        found_breakers = [breaker_row(r, (0, 0), []) for r in rows]
        out["breakers"] = {b.name: b.hold_text() for b in found_breakers if b.holds}
    keys = sorted({t.rate_limit for t in ready if t.rate_limit is not None})
    if keys:
        found = {r.key: r for r in conn.execute(sa.select(s.rate_limits).where(s.rate_limits.c.key.in_(keys))).all()}
        out["rates"] = {
            k: RateLimit(k, float(found[k].rate), int(found[k].burst), bucket(found[k], dt.datetime.now(dt.UTC)))
            if k in found
            else None
            for k in keys
        }
    return out


def _flying_of(conn: Connection, tenant: str) -> list[Any]:
    c = t_tasks.c
    return list(conn.execute(sa.select(c.run_id).where(c.state.in_(["QUEUED", "RUNNING"]), c.tenant == tenant)).all())


#: how explain names what another tenant holds, to a caller bound to a tenant
OTHERS = "another tenant"


def _veiled(limits: dict[str, Any], tenant: str, own_runs: set[str]) -> dict[str, Any]:
    """``limits`` as a caller bound to ``tenant`` may read them: the pool slots other tenants'
    tasks hold are counted under :data:`OTHERS` (not by run), and the other tenants of the fair
    share are not named."""
    out = dict(limits)
    if "pools" in out:
        pools: dict[str, LimitUse | None] = {}
        for name, use in out["pools"].items():
            if use is None:
                pools[name] = None
                continue
            holders: dict[str, int] = {}
            for holder, n in use.holders.items():
                shown = holder if holder.split("/", 1)[0] in own_runs else OTHERS
                holders[shown] = holders.get(shown, 0) + n
            pools[name] = LimitUse(use.limit, use.in_flight, holders)
        out["pools"] = pools
    if "shares" in out:
        names: dict[str, str] = {}
        for per_queue in out["shares"].values():
            for other in sorted(per_queue):
                if other != tenant and other not in names:
                    names[other] = f"{OTHERS} {len(names) + 1}"
        out["shares"] = {
            queue: {names.get(n, n): v for n, v in per_queue.items()} for queue, per_queue in out["shares"].items()
        }
    return out


def _shares(conn: Connection, tenant: str, scopes: dict[str, set[str]]) -> dict[str, Any]:
    """Per queue, the tenants' tasks in flight on the queues of the workers consuming it, their
    weights and whether they have READY work there; and ``tenant``'s tasks in flight by run."""
    c = t_tasks.c
    every = sorted(set().union(*scopes.values()))
    flying = conn.execute(
        sa.select(c.tenant, c.queue, c.run_id).where(c.state.in_(["QUEUED", "RUNNING"]), c.queue.in_(every))
    ).all()
    ready = set(
        conn.execute(sa.select(c.tenant, c.queue).where(c.state == "READY", c.queue.in_(every)).distinct()).all()
    )
    weights = {n: float(w) for n, w in conn.execute(sa.select(s.tenants.c.name, s.tenants.c.weight)).all()}
    shares: dict[str, dict[str, tuple[int, float, bool]]] = {}
    for queue, scope in scopes.items():
        names = {r.tenant for r in flying if r.queue in scope} | {n for n, q in ready if q in scope}
        shares[queue] = {
            n: (
                sum(1 for r in flying if r.queue in scope and r.tenant == n),
                weights.get(n, 1.0),
                any(q in scope for m, q in ready if m == n),
            )
            for n in names
        }
    runs: dict[str, int] = {}
    for r in flying:
        if r.tenant == tenant:
            runs[r.run_id] = runs.get(r.run_id, 0) + 1
    return {"shares": shares, "tenant_runs": runs}


def _as_time(value: Any) -> dt.datetime:
    """A database time as an aware datetime."""
    found = aware(value)
    assert found is not None
    return found
