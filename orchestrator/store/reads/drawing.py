"""What the web app's DAG drawing needs of a run, and nothing more: a few plain columns of
every task (through the driver's cursor, :meth:`ReadsBase._plain`: a run of 50,000 tasks is
drawn from tuples, not SQLAlchemy rows), its edges and their labels, and a map's children
counted or listed in map order."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ...core.dag.labels import edge_labels
from ...core.errors import TaskNotFound
from .base import ReadsBase, t_edges, t_runs, t_tasks


class DrawingReads(ReadsBase):
    """A run's tasks and edges as the drawing (:mod:`orchestrator.core.graph`) wants them."""

    def drawing_rows(self, run_id: str) -> list[tuple[Any, ...]]:
        """What the DAG drawing needs of every task of the run, and nothing more:
        ``(key, task name, state, trigger rule, attempt)``; raise :class:`RunNotFound`."""
        return self._plain(
            run_id,
            f"SELECT key, task_name, state, trigger_rule, attempt FROM {t_tasks.name} WHERE run_id = %(run)s",
        )

    def drawing_tasks(self, run_id: str) -> list[tuple[Any, ...]]:
        """Every task of the run that is not a map's child, as ``(key, task name, state, trigger
        rule, attempt, skip reason, is a map)``; raise :class:`RunNotFound`."""
        return self._plain(
            run_id,
            "SELECT key, task_name, state, trigger_rule, attempt, skip_reason, map_spec IS NOT NULL"
            f" FROM {t_tasks.name} WHERE run_id = %(run)s AND map_parent IS NULL",
        )

    def map_child_counts(self, run_id: str) -> dict[str, dict[str, int]]:
        """Each mapped node's children counted per state, in the database (a map of 100,000
        children is a few rows here): ``{map key: {state: n}}``; raise :class:`RunNotFound`."""
        maps: dict[str, dict[str, int]] = {}
        for parent, state, n in self._plain(
            run_id,
            f"SELECT map_parent, state, count(*) FROM {t_tasks.name} WHERE run_id = %(run)s"
            " AND map_parent IS NOT NULL GROUP BY map_parent, state",
        ):
            maps.setdefault(parent, {})[state] = int(n)
        return maps

    def edge_list(self, run_id: str) -> list[tuple[Any, ...]]:
        """The run's edges ``(parent key, child key)`` in no set order (the drawing's skeleton);
        raise :class:`RunNotFound`."""
        return self._plain(run_id, f"SELECT parent_key, child_key FROM {t_edges.name} WHERE run_id = %(run)s")

    def edge_labels(self, run_id: str) -> dict[tuple[str, str], str]:
        """The labels of the run's edges (``DAG.label``, kept in the run's DAG snapshot) by
        ``(parent key, child key)``; raise :class:`RunNotFound`."""
        rows = self._plain(run_id, f"SELECT dag_snapshot -> 'labels' FROM {t_runs.name} WHERE id = %(run)s")
        return edge_labels({"labels": rows[0][0]}) if rows else {}

    def map_children(self, run_id: str, key: str, *, limit: int) -> tuple[list[Any], int]:
        """The first ``limit`` children of the map ``key`` in map order, as ``(key, state,
        attempt, skip reason, map index, map key)``, and how many it has. Raises
        :class:`RunNotFound`, or :class:`TaskNotFound` when ``key`` is not a mapped node of the run."""
        c = t_tasks.c
        head = self._of_run(run_id, sa.select(c.map_spec.isnot(None)).where(c.run_id == run_id, c.key == key))
        if not head or not head[0][0]:
            raise TaskNotFound(f"run {run_id!r} has no mapped task {key!r}")
        mine = [c.run_id == run_id, c.map_parent == key]
        total = int(self._of_run(run_id, sa.select(sa.func.count()).where(*mine))[0][0])
        q = (
            sa.select(c.key, c.state, c.attempt, c.skip_reason, c.map_index, c.map_key)
            .where(*mine)
            .order_by(c.map_index)
            .limit(limit)
        )
        return list(self._of_run(run_id, q)), total
