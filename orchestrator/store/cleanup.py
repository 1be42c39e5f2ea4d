"""Pruning finished runs (``orchestrator db clean``, the shape of ``airflow db clean``).

A run is removed with its tasks, edges and ledger rows once it is final (SUCCEEDED, FAILED or
CANCELLED) and was created and finished before the cut-off; a RUNNING run is never touched. The
work goes in batches of runs, one transaction each: the batch's run rows are locked ``FOR UPDATE
SKIP LOCKED`` (an operator's clear, which takes the run's row lock to reopen it, either waits and
then finds no run, or holds it and the batch leaves that run), optionally written to an archive
(one JSON object per run, with its tasks, edges and ledger), then deleted. Each batch is short, so
the hot path's transactions never wait behind one long delete and vacuum keeps up."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import schema as s
from .database import Database

t_runs, t_tasks, t_edges, t_events = s.runs, s.tasks, s.edges, s.events
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class Cleaned:
    """What a clean removed (or, with ``dry_run``, would remove)."""

    runs: int = 0
    tasks: int = 0
    edges: int = 0
    events: int = 0
    batches: int = 0
    oldest: dt.datetime | None = None
    newest: dt.datetime | None = None
    by_state: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs, "tasks": self.tasks, "edges": self.edges, "events": self.events,
            "batches": self.batches, "by_state": self.by_state,
            "oldest": self.oldest.isoformat() if self.oldest else None,
            "newest": self.newest.isoformat() if self.newest else None,
        }  # fmt: skip


def _plain(row: Any) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row._mapping.items()}


class Cleanup:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _where(self, before: dt.datetime, tenant: str | None) -> list[Any]:
        where = [t_runs.c.state.in_(FINAL), t_runs.c.created_at < before, t_runs.c.finished_at < before]
        if tenant is not None:
            where.append(t_runs.c.tenant == tenant)
        return where

    def count(self, before: dt.datetime, tenant: str | None = None) -> Cleaned:
        """What :meth:`clean` would remove now (nothing is written)."""

        def read(conn: Connection) -> Cleaned:
            found = Cleaned()
            runs = sa.select(t_runs.c.id).where(*self._where(before, tenant)).subquery()
            for state, n, oldest, newest in conn.execute(
                sa.select(t_runs.c.state, sa.func.count(), sa.func.min(t_runs.c.created_at),
                          sa.func.max(t_runs.c.created_at))
                .where(*self._where(before, tenant)).group_by(t_runs.c.state)
            ):  # fmt: skip
                found.by_state[state] = n
                found.runs += n
                found.oldest = oldest if found.oldest is None else min(found.oldest, oldest)
                found.newest = newest if found.newest is None else max(found.newest, newest)
            for table, attr in ((t_tasks, "tasks"), (t_edges, "edges"), (t_events, "events")):
                n = conn.execute(
                    sa.select(sa.func.count()).select_from(table).where(table.c.run_id.in_(sa.select(runs.c.id)))
                ).scalar_one()
                setattr(found, attr, n)
            return found

        return self.db.read(read)

    def clean(
        self,
        before: dt.datetime,
        *,
        batch: int = 500,
        tenant: str | None = None,
        archive: IO[str] | None = None,
        progress: Callable[[Cleaned], None] | None = None,
        max_batches: int | None = None,
        pause: float = 0.0,
    ) -> Cleaned:
        """Remove the final runs created and finished before ``before`` (of ``tenant``, or all),
        ``batch`` runs per transaction, writing each to ``archive`` first (JSON lines); returns
        the totals. ``progress`` is called after each batch; ``pause`` seconds are left to the
        running work between two batches."""
        total = Cleaned()

        def one(conn: Connection) -> Cleaned:
            done = Cleaned(batches=1)
            rows = conn.execute(
                sa.select(t_runs)
                .where(*self._where(before, tenant))
                .order_by(t_runs.c.created_at)
                .limit(batch)
                .with_for_update(skip_locked=True)
            ).all()
            if not rows:
                return Cleaned()
            ids = [r.id for r in rows]
            if archive is not None:
                self._archive(conn, rows, ids, archive)
            done.events = conn.execute(t_events.delete().where(t_events.c.run_id.in_(ids))).rowcount or 0
            done.edges = conn.execute(t_edges.delete().where(t_edges.c.run_id.in_(ids))).rowcount or 0
            done.tasks = conn.execute(t_tasks.delete().where(t_tasks.c.run_id.in_(ids))).rowcount or 0
            done.runs = conn.execute(t_runs.delete().where(t_runs.c.id.in_(ids))).rowcount or 0
            for r in rows:
                done.by_state[r.state] = done.by_state.get(r.state, 0) + 1
            done.oldest, done.newest = rows[0].created_at, rows[-1].created_at
            return done

        while max_batches is None or total.batches < max_batches:
            if pause > 0 and total.batches:
                time.sleep(pause)
            done = self.db.transaction(one)
            if not done.runs:
                break
            if archive is not None:
                archive.flush()
            total.runs += done.runs
            total.tasks += done.tasks
            total.edges += done.edges
            total.events += done.events
            total.batches += 1
            for state, n in done.by_state.items():
                total.by_state[state] = total.by_state.get(state, 0) + n
            total.oldest = total.oldest or done.oldest
            total.newest = done.newest
            if progress is not None:
                progress(total)
        return total

    @staticmethod
    def _archive(conn: Connection, rows: Sequence[Any], ids: list[str], out: IO[str]) -> None:
        tasks: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        edges: dict[str, list[list[str]]] = {i: [] for i in ids}
        events: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        for r in conn.execute(sa.select(t_tasks).where(t_tasks.c.run_id.in_(ids)).order_by(t_tasks.c.key)):
            tasks[r.run_id].append(_plain(r))
        for r in conn.execute(sa.select(t_edges).where(t_edges.c.run_id.in_(ids))):
            edges[r.run_id].append([r.parent_key, r.child_key])
        for r in conn.execute(sa.select(t_events).where(t_events.c.run_id.in_(ids)).order_by(t_events.c.id)):
            events[r.run_id].append(_plain(r))
        for run in rows:
            doc = {"run": _plain(run), "tasks": tasks[run.id], "edges": edges[run.id], "events": events[run.id]}
            out.write(json.dumps(doc, default=str) + "\n")
