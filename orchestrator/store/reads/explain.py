"""What ``explain`` (:mod:`orchestrator.core.explain`) needs about a run, read in one
connection: the run, its tasks (or those a page asks about, with their parents), the ledger
rows that decided them, the live workers (with the task names they registered, and for a run
pinned to a code version the versions of its queues' workers), the READY tasks ahead of each,
and the limits that hold them (as a caller bound to a tenant may read them: other tenants are
not named)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...core.errors import RunNotFound
from ...core.explain import ExplainInput, LimitUse
from ...core.models import RateLimit
from ...core.workers import split_pinned
from .. import schema as s
from ..breakers import breaker_row
from ..dbtime import db_after, db_now
from ..limits import bucket
from ..workers import WorkerRegistry
from .base import ReadsBase, t_edges, t_events, t_runs, t_tasks, t_workers

#: how explain names what another tenant holds, to a caller bound to a tenant
OTHERS = "another tenant"

c_tasks = t_tasks.c


class ExplainReads(ReadsBase):
    """The input of ``explain``."""

    def explain_input(
        self, run_id: str, *, worker_ttl: float, depth: int, keys: Collection[str] | None = None
    ) -> ExplainInput:
        """What ``explain`` needs about a run, read in one connection (raise :class:`RunNotFound`).
        With ``keys``, only what explaining those tasks needs: them, their edges in and their
        parents (a page of a 50,000-task run reads a few hundred rows, not the run), the child
        of the map before that holds a chained map child's item, and the ledger rows that
        decided them (out of PENDING, or into SKIPPED)."""
        with self.db.engine.connect() as conn:
            found_run = conn.execute(
                sa.select(t_runs.c.state, t_runs.c.tenant, t_runs.c.dag_name, t_runs.c.max_active_tasks).where(
                    *self._run_where(run_id)
                )
            ).first()
            if found_run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            run_state, tenant, dag_name, max_active = found_run
            task_where, edge_where = _scope(conn, run_id, keys)
            tasks = _explained_tasks(conn, task_where)
            ledger = _decisions(conn, run_id, keys)
            edges = [
                (p, ch)
                for p, ch in conn.execute(sa.select(t_edges.c.parent_key, t_edges.c.child_key).where(*edge_where)).all()
            ]
            workers = _live_workers(conn, worker_ttl)
            groups = [set(queues) for queues, _ in workers]
            ahead = _ahead(conn, run_id, tasks, groups)
            in_flight = {
                q: int(n)
                for q, n in conn.execute(
                    sa.select(c_tasks.queue, sa.func.count())
                    .where(c_tasks.state.in_(["QUEUED", "RUNNING"]))
                    .group_by(c_tasks.queue)
                ).all()
            }
            now = conn.execute(sa.select(db_now())).scalar_one()
            ready = [t for t in tasks if t.state == "READY"]
            limits = self._limits(conn, run_id, (str(tenant), str(dag_name), max_active), ready, groups, now)
            registry = WorkerRegistry(self.db, worker_ttl=worker_ttl)
            registered = registry.registered(conn, {t.queue for t in ready})
            pinned = {base for base, version in map(split_pinned, registered) if version is not None}
            versions = registry.versions(conn, pinned) if pinned else {}
        return ExplainInput(
            run_state, tasks, edges, workers, ahead, in_flight, depth, now, tenant=str(tenant), dag=str(dag_name),
            ledger=ledger, registered=registered, versions=versions, **limits,
        )  # fmt: skip

    def _limits(
        self,
        conn: Connection,
        run_id: str,
        run: tuple[str, str, int | None],
        ready: Sequence[Any],
        groups: list[set[str]],
        now: Any,
    ) -> dict[str, Any]:
        """The limits holding the run's READY tasks and the fair share of their queues, as these
        reads may see them (a caller bound to a tenant: other tenants unnamed)."""
        tenant, dag_name, max_active = run
        limits = _limit_uses(conn, run_id, tenant, dag_name, max_active, ready, now) if ready else {}
        if ready:
            scopes = {q: set().union(*(g for g in groups if q in g)) or {q} for q in {t.queue for t in ready}}
            limits.update(_shares(conn, tenant, scopes))
        if self.tenant is not None:
            limits = _veiled(limits, tenant, {r.run_id for r in _flying_of(conn, self.tenant)})
        return limits


def _scope(conn: Connection, run_id: str, keys: Collection[str] | None) -> tuple[list[Any], list[Any]]:
    """The conditions on ``orc_tasks`` and ``orc_edges`` of what explaining ``keys`` (``None``:
    the whole run) reads: those tasks, their parents, the map children holding their items and the
    setups of their setup scopes."""
    c = c_tasks
    edge_where = [t_edges.c.run_id == run_id]
    task_where = [c.run_id == run_id]
    if keys is not None:
        wanted = sorted(set(keys))
        edge_where.append(t_edges.c.child_key.in_(wanted))
        parents = conn.execute(sa.select(t_edges.c.parent_key).where(*edge_where)).scalars().all()
        item_where = (c.run_id == run_id, c.key.in_(wanted), c.map_item_from.is_not(None))
        items = conn.execute(sa.select(c.map_item_from).where(*item_where)).scalars().all()
        scope_where = (c.run_id == run_id, c.key.in_(wanted), c.setup_scope.is_not(None))
        setups = [k for ks in conn.execute(sa.select(c.setup_scope).where(*scope_where)).scalars() for k in ks]
        task_where.append(c.key.in_(sorted(set(wanted) | set(parents) | set(items) | set(setups))))
    return task_where, edge_where


def _explained_tasks(conn: Connection, task_where: list[Any]) -> list[Any]:
    """The columns of the tasks explain reasons about, in key order."""
    c = c_tasks
    st = s.stripes.c
    # a striped fan-in's successes held in its stripes (store/stripes.py) are done parents too
    held = sa.func.coalesce(
        sa.select(sa.func.sum(st.pending)).where(st.run_id == c.run_id, st.key == c.key).scalar_subquery(), 0
    )
    return list(
        conn.execute(
            sa.select(
                c.key, c.state, c.attempt, c.max_attempts, c.trigger_rule, c.n_upstream,
                (c.n_done + held).label("n_done"), (c.n_succeeded + held).label("n_succeeded"), c.n_failed,
                c.n_skipped, c.queue, c.priority, c.not_before,
                c.dispatched_at, c.worker, c.lease_expires_at, c.pool, c.pool_slots, c.rate_limit,
                c.resources,
                # dynamic DAGs: skips, the counters of the new rules, maps
                c.skip_reason, c.n_upstream_failed, c.n_setup, c.n_setup_ok, c.n_setup_skipped,
                c.min_success_ratio, c.map_spec.is_not(None).label("is_map"), c.map_parent, c.map_index,
                c.map_key, c.map_item_from, c.map_total, c.map_done, c.map_ok, c.map_failed, c.map_skipped,
                c.waiting,
                # the watchdog: the task name (is it registered?), a worker's drop, the flag
                c.task_name, c.dropped_by, c.stuck,
                # Airflow's setup constraint: the setups the task answers to beside its parents
                c.setup_scope,
                # a child-run node: the child run it waits on
                c.child_run_id,
            )
            .where(*task_where)
            .order_by(c.key)
        ).all()
    )  # fmt: skip


def _decisions(conn: Connection, run_id: str, keys: Collection[str] | None) -> dict[str, dict[str, dict[str, Any]]]:
    """The ledger rows that decided the tasks (out of PENDING, or into SKIPPED): ``{key: {to
    state or "decided": {from, to, reason}}}``."""
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
    return ledger


def _live_workers(conn: Connection, worker_ttl: float) -> list[tuple[list[str], int]]:
    """The workers seen within ``worker_ttl``: (queues, concurrency)."""
    return [
        (list(queues), int(n))
        for queues, n in conn.execute(
            sa.select(t_workers.c.queues, t_workers.c.concurrency).where(t_workers.c.seen_at > db_after(-worker_ttl))
        ).all()
    ]


def _ahead(conn: Connection, run_id: str, tasks: Sequence[Any], groups: list[set[str]]) -> dict[str, int]:
    """READY tasks ahead of each of the run's READY tasks: in every queue that the live workers
    consuming its queue also take, by priority, then age (admission's order)."""
    c = c_tasks
    ahead: dict[str, int] = {}
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
    return ahead


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
