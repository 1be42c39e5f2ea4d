"""The raw rows the invariant checker and the chaos soak inspect (:meth:`Reads.snapshot`),
and the counts the kit and the soak watch: finished runs, tasks per state, refused ledger
rows, the reconciler on duty, tasks in flight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...core.states import RunState
from .. import schema as s
from ..probes import probe_effects
from .base import ReadsBase, t_edges, t_events, t_runs, t_tasks


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


class DiagnosticReads(ReadsBase):
    """Rows and counts for checking and watching runs (a bound caller: its tenant's runs only)."""

    def snapshot(self, run_ids: Sequence[str]) -> Snapshot:
        """Every row of ``run_ids`` (those these reads may see), read in one connection."""
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
        """Each task id's deliveries beyond the first."""
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
        """The tasks of ``run_ids`` counted per state."""
        with self.db.engine.connect() as conn:
            run_ids = self._visible_ids(conn, run_ids)
            found = conn.execute(
                sa.select(t_tasks.c.state, sa.func.count())
                .where(t_tasks.c.run_id.in_(list(run_ids)))
                .group_by(t_tasks.c.state)
            ).all()
        return {st: int(n) for st, n in found}

    def rejected_events(self, run_ids: Sequence[str]) -> int:
        """How many ledger rows of ``run_ids`` record a refused transition."""
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
