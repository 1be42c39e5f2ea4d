"""Reads of runs: one run (its view, its state, what a rerun repeats, its logical date, the
resources its tasks use), the runs list, and runs' trace contexts (the publisher's)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import sqlalchemy as sa

from ...core.errors import RunNotFound
from ...core.models import RunView
from ...core.states import RunState
from .. import rows
from .base import ReadsBase, t_runs, t_tasks

#: the columns of ``orc_runs`` a :class:`RunView` needs: not the DAG's snapshot (a 50,000-task
#: run's is megabytes of JSON, decoded for nothing by every run page and runs list)
RUN_VIEW_COLUMNS = [c for c in t_runs.c if c.name != "dag_snapshot"]


class RunReads(ReadsBase):
    """A run and the runs list, with their tasks counted per state."""

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
        tags: Mapping[str, str] | None = None,
    ) -> list[RunView]:
        """The newest runs with their per-state task counts (so ``needs_attention`` is true),
        optionally of one tenant, DAG or run state, and holding every tag of ``tags``
        (containment, ``tags @> ...``: ``ix_orc_runs_tags``); ``offset`` pages further back.
        Scoped reads list their tenant's runs only (another ``tenant``: none)."""
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
        if tags:
            q = q.where(t_runs.c.tags.contains(dict(tags)))

        def read(conn: Any) -> tuple[Any, dict[str, dict[str, int]]]:
            found = conn.execute(q).all()
            return found, self._counts(conn, [r.id for r in found])

        found, counts = self.db.read(read)
        return [rows.run_view(r, counts.get(r.id, {})) for r in found]

    def rerun_source(self, run_id: str) -> Any:
        """The run's DAG snapshot (with its params), tenant, version and tags, to run it again; raise
        :class:`RunNotFound`."""
        q = sa.select(
            t_runs.c.dag_snapshot.label("snapshot"), t_runs.c.tenant, t_runs.c.dag_version, t_runs.c.tags
        ).where(*self._run_where(run_id))
        with self.db.engine.connect() as conn:
            row = conn.execute(q).first()
        if row is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        return row

    def logical_date(self, run_id: str) -> str | None:
        """The run's logical date (ISO 8601), or ``None``."""
        query = sa.select(t_runs.c.logical_date).where(*self._run_where(run_id))
        found: str | None = self.db.read(lambda conn: conn.execute(query).scalar())
        return found

    def trace_contexts(self, run_ids: Collection[str]) -> dict[str, dict[str, str] | None]:
        """Each run's trace context as its submitter had it (``orc_runs.trace_context``: text
        headers, W3C's and Sentry's), ``None`` for a run submitted without one; a run these reads
        may not see, or that does not exist, is left out. One query and one try: the publisher
        asks on its way to the broker, where an outage must not hold messages back."""
        ids = list(run_ids)
        if not ids:
            return {}
        q = sa.select(t_runs.c.id, t_runs.c.trace_context).where(t_runs.c.id.in_(ids))
        if self.tenant is not None:
            q = q.where(t_runs.c.tenant == self.tenant)
        with self.db.engine.connect() as conn:
            found = conn.execute(q).all()
        return {
            run_id: {str(k): str(v) for k, v in carrier.items()} if isinstance(carrier, dict) and carrier else None
            for run_id, carrier in found
        }

    def run_resources(self, run_id: str) -> list[str]:
        """The resources the run's tasks use (their circuit breakers), sorted; raise
        :class:`RunNotFound`."""
        used = sa.func.unnest(t_tasks.c.resources).label("resource")
        q = sa.select(used).where(t_tasks.c.run_id == run_id).distinct()
        return sorted(str(r) for (r,) in self._of_run(run_id, q))
