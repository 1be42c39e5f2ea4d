"""Concurrency and rate limits at admission: named pools (``orc_pools``), deployment-wide
token buckets (``orc_rate_limits``), per-DAG limits (``orc_dag_limits``); a run's
``max_active_tasks`` and a tenant's ``max_running`` live on their own rows.

Every concurrency limit is counted from the task rows (QUEUED + RUNNING), never from a counter
kept beside them: a slot frees exactly when its task ends, its lease expires or its run is
cancelled, so nothing can leak after a crash. A rate limit's bucket holds ``burst`` tokens and
refills at ``rate`` per second; admission takes one token per task it moves to QUEUED.

Admission checks them in the server functions ``orc_limit_held_v1`` and ``orc_admit_from_v2``
(``store/sql/``), under the admission lock; this module keeps the rows.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.dag import DAG, LIMIT_NAME_RE, MAX_ACTIVE_TASKS, MAX_NAME_CHARS, MAX_POOL_SLOTS, short, text_problem
from ..core.errors import UnknownLimitError, ValidationError
from ..core.models import Pool, RateLimit
from ..core.states import TaskState
from . import schema as s
from .database import Database
from .dbtime import aware, db_now

T = TaskState
t_tasks, t_runs, t_pools, t_rates, t_dag_limits = s.tasks, s.runs, s.pools, s.rate_limits, s.dag_limits
IN_FLIGHT = (T.QUEUED.value, T.RUNNING.value)

#: the most tokens per second a rate limit may refill, and the largest burst
MAX_RATE = 1_000_000.0
MAX_BURST = 1_000_000

_RATE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*")
_PER = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0, "hour": 3600.0}


def parse_rate(text: str) -> float:
    """``"10/s"``, ``"600/m"``, ``"5/h"`` -> tokens per second; a malformed or non-positive rate
    raises :class:`ValidationError` naming it."""
    m = _RATE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValidationError(f"rate {short(text)} must look like 10/s, 600/m or 5/h")
    per_second = float(m.group(1)) / _PER[m.group(2)]
    if not 0 < per_second <= MAX_RATE:
        raise ValidationError(f"rate {text.strip()} must be above 0 and at most {MAX_RATE:g}/s")
    return per_second


def check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not LIMIT_NAME_RE.fullmatch(name):
        raise ValidationError(f"{what} {short(name)} must be 1-64 letters, digits, '_', '.', ':' or '-'")
    return name


def check_count(value: Any, what: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValidationError(f"{what} must be an integer from 1 to {most}, not {short(value)}")
    return value


def bucket(row: Any, now: dt.datetime) -> float:
    """Tokens in a rate limit's bucket at ``now``."""
    elapsed = max((now - aware(row.refilled_at)).total_seconds(), 0.0)  # type: ignore[operator]
    return float(min(row.burst, row.tokens + row.rate * elapsed))


class Limits:
    """Pools, rate limits and per-DAG limits: the operator's settings and what holds them now."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # pools
    def set_pool(self, name: str, slots: int, description: str | None = None) -> None:
        check_name(name, "pool")
        check_count(slots, "slots", MAX_POOL_SLOTS)
        values = {"slots": slots, "updated_at": db_now()}
        if description is not None:
            values["description"] = description
        self.db.upsert(t_pools, {"name": name}, values)

    def remove_pool(self, name: str) -> bool:
        return self._delete(t_pools, t_pools.c.name == check_name(name, "pool"))

    def pools(self) -> list[Pool]:
        used = (
            sa.select(t_tasks.c.pool, sa.func.sum(t_tasks.c.pool_slots).label("used"))
            .where(t_tasks.c.state.in_(IN_FLIGHT), t_tasks.c.pool.is_not(None))
            .group_by(t_tasks.c.pool)
            .subquery()
        )
        query = (
            sa.select(t_pools.c.name, t_pools.c.slots, t_pools.c.description, used.c.used)
            .outerjoin(used, used.c.pool == t_pools.c.name)
            .order_by(t_pools.c.name)
        )
        found = self.db.read(lambda conn: conn.execute(query).all())
        return [Pool(r.name, int(r.slots), int(r.used or 0), r.description) for r in found]

    # rate limits
    def set_rate_limit(self, key: str, rate: str | float, burst: int | None = None) -> RateLimit:
        """Define or change a token bucket: ``rate`` as ``"10/s"`` (or tokens per second),
        ``burst`` the bucket's size (default: one second's tokens, at least 1). A changed
        limit starts full."""
        check_name(key, "rate limit")
        per_second = parse_rate(rate) if isinstance(rate, str) else float(rate)
        if isinstance(rate, bool) or not 0 < per_second <= MAX_RATE or math.isnan(per_second):
            raise ValidationError(f"rate must be above 0 and at most {MAX_RATE:g}/s, not {short(rate)}")
        size = max(1, math.ceil(per_second)) if burst is None else check_count(burst, "burst", MAX_BURST)
        now = dt.datetime.now(dt.UTC)
        values = {"rate": per_second, "burst": size, "tokens": float(size), "refilled_at": now, "updated_at": now}
        self.db.upsert(t_rates, {"key": key}, values)
        return RateLimit(key, per_second, size, float(size))

    def remove_rate_limit(self, key: str) -> bool:
        return self._delete(t_rates, t_rates.c.key == check_name(key, "rate limit"))

    def rate_limits(self) -> list[RateLimit]:
        found = self.db.read(lambda conn: conn.execute(sa.select(t_rates).order_by(t_rates.c.key)).all())
        now = dt.datetime.now(dt.UTC)
        return [RateLimit(r.key, float(r.rate), int(r.burst), bucket(r, now)) for r in found]

    # per-DAG limits
    def set_dag_limit(self, tenant: str, dag_name: str, max_running: int | None) -> None:
        """Most tasks QUEUED or RUNNING at once across every run of ``tenant``'s DAG
        ``dag_name`` (``None``: no limit)."""
        problem = text_problem(dag_name, MAX_NAME_CHARS)
        if problem:
            raise ValidationError(f"DAG name {problem}")
        where = (t_dag_limits.c.tenant == tenant, t_dag_limits.c.dag_name == dag_name)
        if max_running is None:
            self._delete(t_dag_limits, *where)
            return
        check_count(max_running, "max running", MAX_ACTIVE_TASKS)
        self.db.upsert(
            t_dag_limits, {"tenant": tenant, "dag_name": dag_name}, {"max_running": max_running, "updated_at": db_now()}
        )

    def dag_limits(self, tenant: str | None = None) -> dict[tuple[str, str], int]:
        """``{(tenant, dag name): max_running}``."""
        query = sa.select(t_dag_limits.c.tenant, t_dag_limits.c.dag_name, t_dag_limits.c.max_running)
        if tenant is not None:
            query = query.where(t_dag_limits.c.tenant == tenant)
        found = self.db.read(lambda conn: conn.execute(query).all())
        return {(t, d): int(m) for t, d, m in found}

    def check_dag(self, dag: DAG) -> None:
        """Refuse a DAG whose nodes name a pool or rate limit that does not exist, or ask more
        slots than their pool has (:class:`UnknownLimitError` / :class:`ValidationError`)."""
        pools = {n.pool for n in dag.nodes.values() if n.pool is not None}
        rates = {n.rate_limit for n in dag.nodes.values() if n.rate_limit is not None}
        if not pools and not rates:
            return
        known_pools, known_rates = self._known(pools, rates)
        for node in dag.nodes.values():
            if node.pool is not None:
                if node.pool not in known_pools:
                    raise UnknownLimitError(
                        f"pool {node.pool!r} does not exist (orchestrator pool set {node.pool} --slots N)",
                        dag=dag.name,
                        node=node.key,
                    )
                if node.pool_slots > known_pools[node.pool]:
                    raise ValidationError(
                        f"pool_slots {node.pool_slots} exceed pool {node.pool!r}'s {known_pools[node.pool]} slots",
                        dag=dag.name,
                        node=node.key,
                    )
            if node.rate_limit is not None and node.rate_limit not in known_rates:
                raise UnknownLimitError(
                    f"rate limit {node.rate_limit!r} does not exist"
                    f" (orchestrator limit set {node.rate_limit} --rate 10/s)",
                    dag=dag.name,
                    node=node.key,
                )

    def _known(self, pools: Iterable[str], rates: Iterable[str]) -> tuple[dict[str, int], set[str]]:
        def read(conn: Connection) -> tuple[dict[str, int], set[str]]:
            found_pools = conn.execute(
                sa.select(t_pools.c.name, t_pools.c.slots).where(t_pools.c.name.in_(list(pools)))
            ).all()
            found_rates = conn.execute(sa.select(t_rates.c.key).where(t_rates.c.key.in_(list(rates)))).scalars()
            return {n: int(k) for n, k in found_pools}, set(found_rates)

        return self.db.read(read)

    def _delete(self, table: sa.Table, *where: Any) -> bool:
        return bool(self.db.transaction(lambda conn: conn.execute(table.delete().where(*where)).rowcount))
