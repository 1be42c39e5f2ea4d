"""Pruning finished runs (``orchestrator db clean``, the shape of ``airflow db clean``).

A run is removed with its tasks, edges, ledger rows and progress reports (``orc_progress``) once it
is final (SUCCEEDED, FAILED or CANCELLED) and was created and finished before the cut-off; a
RUNNING run is never touched. The work goes in batches of runs, one transaction each: the batch's
run rows are locked ``FOR UPDATE SKIP LOCKED`` (an operator's clear, which takes the run's row lock
to reopen it, either waits and then finds no run, or holds it and the batch leaves that run),
optionally written to an archive (one JSON object per run, with its tasks, edges, ledger and each
task's last progress report), then deleted. Each batch is short, so the hot path's transactions
never wait behind one long delete and vacuum keeps up.

The archive is the record of what was removed, so it is written first: a batch's lines are
written and flushed to the disk (``fsync``) inside the batch's transaction, before its delete
commits. A write that fails (a full disk, an I/O error) rolls the batch back: nothing of it is
removed, and an archive given by path is cut back to its length before the batch (no part of a
run is left in it). A commit that fails after the write leaves those runs in the archive and in
the database, and the next clean archives them again: an archive may hold a run twice, never not
at all.

A removed run's idempotency key is kept (``orc_idempotency_keys``: the key, the run's id, its
final state, when it was created and removed), in the batch's transaction, so that a submit with
that key is refused naming the removed run instead of starting a second one (the retried client
request of a run whose outcome is gone). Each clean forgets the keys removed longer ago than
``keep_keys`` (90 days by default). A schedule's runs' keys are not kept: the run of an instant is
keyed by (schedule, instant), and a backfill of an instant whose run was removed makes it again."""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from ..core.errors import OrchestratorError
from . import schema as s
from .database import Database

t_runs, t_tasks, t_edges, t_events, t_keys = s.runs, s.tasks, s.edges, s.events, s.idempotency_keys
t_progress, t_stripes = s.progress, s.stripes
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
#: how long a removed run's idempotency key is kept by default (``db clean --keep-keys``)
KEEP_KEYS = dt.timedelta(days=90)


@dataclass
class Cleaned:
    """What a clean removed (or, with ``dry_run``, would remove)."""

    runs: int = 0
    tasks: int = 0
    edges: int = 0
    events: int = 0
    batches: int = 0
    #: idempotency keys of removed runs kept (``orc_idempotency_keys``), and kept ones forgotten
    keys_kept: int = 0
    keys_forgotten: int = 0
    oldest: dt.datetime | None = None
    newest: dt.datetime | None = None
    by_state: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs, "tasks": self.tasks, "edges": self.edges, "events": self.events,
            "batches": self.batches, "keys_kept": self.keys_kept, "keys_forgotten": self.keys_forgotten,
            "by_state": self.by_state,
            "oldest": self.oldest.isoformat() if self.oldest else None,
            "newest": self.newest.isoformat() if self.newest else None,
        }  # fmt: skip


class ArchiveError(OrchestratorError):
    """The archive could not be opened or a batch could not be written to it (a full disk, a
    missing folder, an I/O error): the failed batch's runs were not removed. ``cleaned`` holds
    what the batches before it removed (and archived)."""

    def __init__(self, message: str, cleaned: Cleaned) -> None:
        super().__init__(message)
        self.cleaned = cleaned


class Archive:
    """Where a clean appends each batch before deleting it: a file by path (opened here, appended
    with ``os.write``, cut back after a failed write) or an open text stream (written and flushed;
    a failed write may leave part of the batch in it). Either way each batch is flushed to the
    disk (``fsync``, where the file has one) before :meth:`write` returns."""

    def __init__(self, target: IO[str] | str | os.PathLike[str]) -> None:
        self.out: IO[str] | None = None
        self.fd: int | None = None
        if isinstance(target, (str, os.PathLike)):
            path = Path(target)
            self.name = str(path)
            try:
                created = not path.exists()
                self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            except OSError as exc:
                where = f" (the folder {path.parent} does not exist)" if not path.parent.is_dir() else ""
                raise ArchiveError(f"cannot open the archive {path}: {exc.strerror}{where}", Cleaned()) from None
            if created:  # its directory entry is on the disk too before any run is removed
                with contextlib.suppress(OSError):
                    folder = os.open(path.parent, os.O_RDONLY)
                    try:
                        _sync(folder)
                    finally:
                        os.close(folder)
        else:
            self.out = target
            self.name = str(getattr(target, "name", "the archive"))

    def write(self, text: str) -> None:
        """Append ``text`` and flush it to the disk; raises ``OSError`` when it cannot."""
        if self.out is not None:
            self.out.write(text)
            self.out.flush()
            try:
                fd = self.out.fileno()
            except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: in memory
                return
            _sync(fd)
            return
        assert self.fd is not None
        try:
            start: int | None = os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:  # a pipe: nothing to cut back
            start = None
        try:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(self.fd, data) :]
            _sync(self.fd)
        except OSError:
            if start is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, start)
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _sync(fd: int) -> None:
    """``fsync``, except on what cannot be synced (a pipe, a character device: EINVAL)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


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
        """What :meth:`clean` would remove now, and the idempotency keys it would keep (nothing is
        written)."""

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
            found.keys_kept = conn.execute(
                sa.select(sa.func.count()).where(
                    *self._where(before, tenant), t_runs.c.idempotency_key.is_not(None), t_runs.c.schedule.is_(None)
                )
            ).scalar_one()
            return found

        return self.db.read(read)

    def clean(
        self,
        before: dt.datetime,
        *,
        batch: int = 500,
        tenant: str | None = None,
        archive: IO[str] | str | os.PathLike[str] | None = None,
        progress: Callable[[Cleaned], None] | None = None,
        max_batches: int | None = None,
        pause: float = 0.0,
        keep_keys: dt.timedelta = KEEP_KEYS,
    ) -> Cleaned:
        """Remove the final runs created and finished before ``before`` (of ``tenant``, or all),
        ``batch`` runs per transaction, each batch written to ``archive`` (a path, or an open text
        stream: JSON lines) and flushed to the disk before its delete commits, keeping the removed
        runs' idempotency keys; then forget the kept keys removed more than ``keep_keys`` ago.
        Returns the totals. ``progress`` is called after each batch; ``pause`` seconds are left
        to the running work between two batches. Raises :class:`ArchiveError` when the archive
        cannot be opened (nothing removed) or a batch cannot be written to it (that batch not
        removed; the batches before it stay removed and archived)."""
        total = Cleaned()
        sink = Archive(archive) if archive is not None else None

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
            if sink is not None:
                text = self._archive(conn, rows, ids)
                try:
                    sink.write(text)  # on the disk before the delete commits
                except OSError as exc:
                    raise ArchiveError(
                        f"the archive {sink.name} could not be written: {exc.strerror or exc}; the batch of"
                        f" {len(ids)} run(s) was not removed ({total.runs} run(s) removed and archived before it)",
                        total,
                    ) from None
            done.keys_kept = self._keep_keys(conn, rows)
            done.events, done.edges, _, _, done.tasks = (
                conn.execute(t.delete().where(t.c.run_id.in_(ids))).rowcount or 0
                for t in (t_events, t_edges, t_progress, t_stripes, t_tasks)
            )
            done.runs = conn.execute(t_runs.delete().where(t_runs.c.id.in_(ids))).rowcount or 0
            for r in rows:
                done.by_state[r.state] = done.by_state.get(r.state, 0) + 1
            done.oldest, done.newest = rows[0].created_at, rows[-1].created_at
            return done

        try:
            while max_batches is None or total.batches < max_batches:
                if pause > 0 and total.batches:
                    time.sleep(pause)
                done = self.db.transaction(one)
                if not done.runs:
                    break
                total.runs += done.runs
                total.tasks += done.tasks
                total.edges += done.edges
                total.events += done.events
                total.keys_kept += done.keys_kept
                total.batches += 1
                for state, n in done.by_state.items():
                    total.by_state[state] = total.by_state.get(state, 0) + n
                total.oldest = total.oldest or done.oldest
                total.newest = done.newest
                if progress is not None:
                    progress(total)
        finally:
            if sink is not None:
                sink.close()
        total.keys_forgotten = self.forget_keys(keep_keys, tenant=tenant, batch=batch * 10)
        return total

    @staticmethod
    def _keep_keys(conn: Connection, rows: Sequence[Any]) -> int:
        """Keep the idempotency keys of the runs about to be removed (not a schedule's)."""
        kept = [
            {"dag_name": r.dag_name, "tenant": r.tenant, "idempotency_key": r.idempotency_key, "run_id": r.id,
             "state": r.state, "created_at": r.created_at}
            for r in rows
            if r.idempotency_key is not None and r.schedule is None
        ]  # fmt: skip
        if not kept:
            return 0
        now = conn.execute(sa.select(sa.func.now())).scalar_one()
        insert = postgresql.insert(t_keys)
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=[t_keys.c.dag_name, t_keys.c.tenant, t_keys.c.idempotency_key],
                set_={c: insert.excluded[c] for c in ("run_id", "state", "created_at", "removed_at")},
            ),
            [{**k, "removed_at": now} for k in kept],
        )
        return len(kept)

    def forget_keys(self, keep: dt.timedelta, *, tenant: str | None = None, batch: int = 5000) -> int:
        """Forget the kept idempotency keys whose run was removed more than ``keep`` ago (of
        ``tenant``, or all), ``batch`` per transaction; returns how many."""
        where = [t_keys.c.removed_at < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, keep.total_seconds())]
        if tenant is not None:
            where.append(t_keys.c.tenant == tenant)
        chosen = sa.select(t_keys.c.dag_name, t_keys.c.tenant, t_keys.c.idempotency_key).where(*where).limit(batch)
        delete = t_keys.delete().where(
            sa.tuple_(t_keys.c.dag_name, t_keys.c.tenant, t_keys.c.idempotency_key).in_(chosen)
        )
        gone = 0
        while True:
            n = self.db.transaction(lambda conn: conn.execute(delete).rowcount or 0)
            gone += n
            if n < batch:
                return gone

    @staticmethod
    def _archive(conn: Connection, rows: Sequence[Any], ids: list[str]) -> str:
        """The batch's runs as JSON lines, each with its tasks, edges, ledger and progress (each
        task's last report, ``orc_progress``: its attempt, state, meta and time)."""
        tasks: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        edges: dict[str, list[list[str]]] = {i: [] for i in ids}
        events: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        progress: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        for r in conn.execute(sa.select(t_tasks).where(t_tasks.c.run_id.in_(ids)).order_by(t_tasks.c.key)):
            tasks[r.run_id].append(_plain(r))
        for r in conn.execute(sa.select(t_edges).where(t_edges.c.run_id.in_(ids))):
            edges[r.run_id].append([r.parent_key, r.child_key])
        for r in conn.execute(sa.select(t_events).where(t_events.c.run_id.in_(ids)).order_by(t_events.c.id)):
            events[r.run_id].append(_plain(r))
        for r in conn.execute(sa.select(t_progress).where(t_progress.c.run_id.in_(ids)).order_by(t_progress.c.key)):
            progress[r.run_id].append(_plain(r))
        lines = []
        for run in rows:
            i = run.id
            doc = {"run": _plain(run), "tasks": tasks[i], "edges": edges[i], "events": events[i]}
            lines.append(json.dumps(doc | {"progress": progress[i]}, default=str) + "\n")
        return "".join(lines)
