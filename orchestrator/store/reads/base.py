"""What every read shares: the database, the tenant a read is scoped to, and the gates that
keep a scoped read to its tenant's rows (a run of another tenant is :class:`RunNotFound`
exactly like a run that does not exist)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ...core.errors import RunNotFound
from .. import schema as s
from ..database import Database
from ..dbtime import aware

t_tasks, t_runs, t_edges, t_events, t_workers = s.tasks, s.runs, s.edges, s.events, s.workers


class ReadsBase:
    """The database and the tenant of a :class:`~orchestrator.store.reads.Reads`, and the
    conditions and one-connection helpers its reads are built from."""

    def __init__(self, db: Database, *, tenant: str | None = None) -> None:
        self.db = db
        #: the tenant these reads see (``None``: every tenant, the deployment's operator)
        self.tenant = tenant

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

    def _of_run(self, run_id: str, query: Any) -> Any:
        """Rows of one run these reads may see (:class:`RunNotFound` otherwise), in one connection."""

        def read(conn: Any) -> Any:
            self._gate(conn, run_id)
            return conn.execute(query).all()

        return self.db.read(read)

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

    def _visible_ids(self, conn: Any, run_ids: Sequence[str]) -> list[str]:
        """The runs of ``run_ids`` these reads may see (a bound caller: its tenant's only)."""
        ids = list(run_ids)
        if self.tenant is None or not ids:
            return ids
        return list(
            conn.execute(sa.select(t_runs.c.id).where(t_runs.c.id.in_(ids), t_runs.c.tenant == self.tenant)).scalars()
        )

    @staticmethod
    def _counts(conn: Any, run_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Each run's tasks counted per state."""
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


def as_time(value: Any) -> dt.datetime:
    """A database time as an aware datetime."""
    found = aware(value)
    assert found is not None
    return found
