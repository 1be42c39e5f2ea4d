"""Schedules (``orc_schedules``) and their firings (``orc_schedule_firings``).

Every change of a schedule's firing state happens under its row lock (``SELECT … FOR UPDATE SKIP
LOCKED``: two beats never decide the same schedule at once): which instants came due (judged by
the database clock), which fire and which are recorded as skipped, the next instant. A firing is
written ``pending`` before its run is created and ``fired`` (with the run id) after; the run
itself is unique per (tenant, schedule, logical date) (``uq_orc_runs_schedule_instant``), so a beat that
dies between the two, a second beat or a backfill trying the same instant finds the run instead
of creating another.

A schedule is keyed by (tenant, name): names are unique per tenant, and two tenants may each
have a schedule called ``nightly``. :class:`ScheduleRows` may be scoped to a tenant
(:meth:`ScheduleRows.scoped`, what an orchestrator bound to a tenant works through): every query
then carries ``tenant = :tenant``, so another tenant's schedule is not found, cannot be changed,
paused, fired or removed, and a beat bound to a tenant fires its tenant's schedules only. What
writes a firing, or decides one schedule, works on rows scoped to that schedule's tenant.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from ..core.errors import ValidationError
from ..core.states import RunState
from . import schema as s
from .database import Database
from .dbtime import aware, db_now

t_schedules, t_firings, t_runs = s.schedules, s.firings, s.runs


def iso(at: dt.datetime) -> str:
    """The canonical logical date of an instant: ISO 8601 in UTC (``2026-03-08T07:30:00+00:00``)."""
    return at.astimezone(dt.UTC).isoformat()


class ScheduleRows:
    def __init__(self, db: Database, *, tenant: str | None = None) -> None:
        self.db = db
        #: the tenant whose schedules these rows are (``None``: every tenant's)
        self.tenant = tenant

    def scoped(self, tenant: str | None) -> ScheduleRows:
        """These rows as ``tenant`` sees them (``None``: every tenant's)."""
        return self if tenant == self.tenant else ScheduleRows(self.db, tenant=tenant)

    def _owner(self) -> str:
        """The tenant of the schedule being written (rows that write a firing are scoped)."""
        if self.tenant is None:
            raise RuntimeError("schedule rows must be scoped to the schedule's tenant to write its firings")
        return self.tenant

    def _mine(self, *where: Any) -> list[Any]:
        """``where`` and, when scoped, the schedule's tenant."""
        found = list(where)
        if self.tenant is not None:
            found.append(t_schedules.c.tenant == self.tenant)
        return found

    def _key(self, name: str) -> list[Any]:
        """The schedule ``name`` of these rows' tenant."""
        return [t_schedules.c.name == name, t_schedules.c.tenant == self._owner()]

    def _firing(self, name: str) -> list[Any]:
        return [t_firings.c.tenant == self._owner(), t_firings.c.schedule == name]

    def now(self) -> dt.datetime:
        """The database's clock: due-ness is judged by it, never by the beat host's."""
        value = self.db.read(lambda conn: conn.execute(sa.select(db_now())).scalar_one())
        found = aware(value)
        assert found is not None
        return found

    def put(self, name: str, values: dict[str, Any], *, timing_changed: bool) -> bool:
        """Create the schedule (of ``values['tenant']``) or change it; returns whether it was
        new. A schedule whose timing changed starts again from its next instant
        (``values['next_at']``); one whose timing is the same keeps its place (what it decided,
        what is buffered). Names are unique per tenant: another tenant's schedule of the same
        name is another schedule, never seen here."""
        tenant = values["tenant"]
        if self.tenant is not None and tenant != self.tenant:
            raise ValidationError(f"these schedules are tenant {self.tenant!r}'s")
        key = (t_schedules.c.name == name, t_schedules.c.tenant == tenant)

        def tx(conn: Connection) -> bool:
            found = conn.execute(sa.select(t_schedules.c.name).where(*key).with_for_update()).first()
            now = db_now()
            if found is None:
                inserted = conn.execute(
                    postgresql.insert(t_schedules)
                    .values(name=name, created_at=now, updated_at=now, **values)
                    .on_conflict_do_nothing(index_elements=[t_schedules.c.tenant, t_schedules.c.name])
                    .returning(t_schedules.c.name)
                ).first()
                if inserted is not None:
                    return True
                # a concurrent add of the same name won: change that one instead
            changed = dict(values, updated_at=now)
            if not timing_changed and found is not None:
                changed.pop("next_at", None)
            else:
                changed.update(last_at=None, buffered_at=None)
            conn.execute(t_schedules.update().where(*key).values(**changed))
            return False

        return self.db.transaction(tx)

    def get(self, name: str) -> Any:
        """The schedule ``name`` of these rows' tenant (unscoped: of any tenant; see :meth:`find`)."""
        query = sa.select(t_schedules).where(*self._mine(t_schedules.c.name == name)).order_by(t_schedules.c.tenant)
        return self.db.read(lambda conn: conn.execute(query).first())

    def find(self, name: str) -> list[Any]:
        """Every schedule called ``name`` these rows see (scoped: at most one)."""
        query = sa.select(t_schedules).where(*self._mine(t_schedules.c.name == name)).order_by(t_schedules.c.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def all(self) -> list[Any]:
        query = sa.select(t_schedules).where(*self._mine()).order_by(t_schedules.c.name, t_schedules.c.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def update(self, name: str, **values: Any) -> bool:
        def tx(conn: Connection) -> bool:
            query = t_schedules.update().where(*self._key(name)).values(updated_at=db_now(), **values)
            return bool(conn.execute(query).rowcount)

        return self.db.transaction(tx)

    def remove(self, name: str) -> bool:
        def tx(conn: Connection) -> bool:
            mine = conn.execute(sa.select(t_schedules.c.name).where(*self._key(name)).with_for_update()).first()
            if mine is None:
                return False
            conn.execute(t_firings.delete().where(*self._firing(name)))
            return bool(conn.execute(t_schedules.delete().where(*self._key(name))).rowcount)

        return self.db.transaction(tx)

    def due(self, now: dt.datetime) -> list[tuple[str, str]]:
        """Schedules to look at, as (tenant, name): not paused, and their next instant passed or
        an instant buffered."""
        c = t_schedules.c
        query = (
            sa.select(c.tenant, c.name)
            .where(*self._mine(c.paused.is_(False), sa.or_(c.next_at <= now, c.buffered_at.is_not(None))))
            .order_by(c.next_at)
        )
        return [(r.tenant, r.name) for r in self.db.read(lambda conn: conn.execute(query).all())]

    def next_at(self, exclude: Collection[tuple[str, str]] = ()) -> dt.datetime | None:
        """The soonest next instant of any schedule that is not paused (nor in ``exclude``:
        (tenant, name) pairs)."""
        c = t_schedules.c
        query = sa.select(sa.func.min(c.next_at)).where(*self._mine(c.paused.is_(False)))
        if exclude:
            query = query.where(sa.tuple_(c.tenant, c.name).not_in(sorted(exclude)))
        return aware(self.db.read(lambda conn: conn.execute(query).scalar()))

    def decide(self, name: str, fn: Callable[[Connection, Any, dt.datetime, list[str]], Any]) -> Any:
        """Under the schedule's row lock: ``fn(conn, row, now, running_run_ids)`` decides and
        writes; returns what ``fn`` returns, or ``None`` when another beat holds the schedule or
        it is gone. The running runs are the schedule's tenant's."""

        def tx(conn: Connection) -> Any:
            row = conn.execute(sa.select(t_schedules).where(*self._key(name)).with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            now = aware(conn.execute(sa.select(db_now())).scalar_one())
            assert now is not None
            return fn(conn, row, now, [r.id for r in self.running(conn, name, row.tenant)])

        return self.db.transaction(tx)

    def advance(self, conn: Connection, name: str, **values: Any) -> None:
        """Within :meth:`decide`: the schedule's new place (last_at, next_at, buffered_at)."""
        conn.execute(t_schedules.update().where(*self._key(name)).values(**values))

    @staticmethod
    def running(conn: Connection, name: str, tenant: str) -> list[Any]:
        """The schedule's RUNNING runs (``id``, ``logical_date``): those of its tenant only."""
        c = t_runs.c
        query = sa.select(c.id, c.logical_date).where(
            c.schedule == name, c.tenant == tenant, c.state == RunState.RUNNING.value
        )
        return list(conn.execute(query).all())

    def running_runs(self, name: str, tenant: str) -> list[Any]:
        return self.db.read(lambda conn: self.running(conn, name, tenant))

    def record(
        self,
        conn: Connection,
        name: str,
        at: dt.datetime,
        state: str,
        kind: str,
        *,
        reason: str | None = None,
        run_id: str | None = None,
        overwrite: bool = True,
        dag_version: int | None = None,
    ) -> bool:
        """Write the firing of ``name`` (of these rows' tenant) at ``at`` (an existing one is
        overwritten, or with ``overwrite=False`` kept as it is); returns whether this call wrote
        it. The insert is insert-if-absent: two writers of one instant (two beats finishing a
        pending firing, a beat and a backfill) never fail on the primary key."""
        where = (*self._firing(name), t_firings.c.logical_date == at)
        values = {
            "state": state, "kind": kind, "reason": reason, "run_id": run_id, "at": db_now(),
            "dag_version": dag_version,
        }  # fmt: skip
        if overwrite and conn.execute(t_firings.update().where(*where).values(**values)).rowcount:
            return True
        query = (
            postgresql.insert(t_firings)
            .values(tenant=self._owner(), schedule=name, logical_date=at, **values)
            .on_conflict_do_nothing(index_elements=[t_firings.c.tenant, t_firings.c.schedule, t_firings.c.logical_date])
            .returning(t_firings.c.state)  # (rowcount says -1 here on psycopg)
        )
        if conn.execute(query).first() is not None:
            return True
        # someone else wrote it meanwhile: overwrite theirs, or keep it
        return overwrite and bool(conn.execute(t_firings.update().where(*where).values(**values)).rowcount)

    def record_pending(self, name: str, at: dt.datetime, kind: str, *, reason: str | None = None) -> bool:
        """Write (in its own transaction) the firing of ``name`` at ``at`` as ``pending``: a
        trigger or a backfill about to create its run."""
        return bool(self.db.transaction(lambda conn: self.record(conn, name, at, "pending", kind, reason=reason)))

    def finish(
        self,
        name: str,
        at: dt.datetime,
        kind: str,
        *,
        run_id: str | None = None,
        error: str | None = None,
        dag_version: int | None = None,
        skipped: str | None = None,
    ) -> None:
        """A pending firing's outcome: ``fired`` with its run (and the registered version it
        ran), ``skipped`` with the reason (its DAG is paused), or ``failed`` with the error (also
        kept on the schedule as ``last_error`` until a firing succeeds)."""

        def tx(conn: Connection) -> None:
            if skipped is not None:
                self.record(conn, name, at, "skipped", kind, reason=skipped, dag_version=dag_version)
            elif error is None:
                self.record(conn, name, at, "fired", kind, run_id=run_id, dag_version=dag_version)
                conn.execute(
                    t_schedules.update()
                    .where(*self._key(name))
                    .values(last_run_id=run_id, last_error=None, last_error_at=None)
                )
            else:
                self.record(conn, name, at, "failed", kind, reason=error)
                conn.execute(
                    t_schedules.update().where(*self._key(name)).values(last_error=error, last_error_at=db_now())
                )

        self.db.transaction(tx)

    def note_error(self, name: str, error: str) -> None:
        self.update(name, last_error=error, last_error_at=db_now())

    def pending(self, older_than: dt.datetime) -> list[Any]:
        """Firings left ``pending`` (their beat died between deciding and creating the run), with
        their ``tenant`` and ``reason`` (what the decision asked besides the run, e.g. cancel
        the running ones)."""
        c = t_firings.c
        query = sa.select(c.tenant, c.schedule, c.logical_date, c.kind, c.reason).where(
            c.state == "pending", c.at < older_than
        )
        if self.tenant is not None:
            query = query.where(c.tenant == self.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def firings(self, name: str, limit: int = 100) -> list[Any]:
        """The schedule's newest firings (of these rows' tenant, when scoped)."""
        c = t_firings.c
        query = sa.select(t_firings).where(c.schedule == name).order_by(c.logical_date.desc()).limit(limit)
        if self.tenant is not None:
            query = query.where(c.tenant == self.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def run_for(self, name: str, logical_date: str, tenant: str | None = None) -> tuple[str, str, int | None] | None:
        """The run (id, state, registered version) the schedule has for an instant, if any: of
        ``tenant`` (default these rows' tenant) only, when known (the schedule's own runs)."""
        c = t_runs.c
        query = sa.select(c.id, c.state, c.dag_version).where(c.schedule == name, c.logical_date == logical_date)
        tenant = tenant if tenant is not None else self.tenant
        if tenant is not None:
            query = query.where(c.tenant == tenant)
        found = self.db.read(lambda conn: conn.execute(query).first())
        return (found.id, found.state, found.dag_version) if found is not None else None

    def last_runs(self, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], tuple[str, str]]:
        """Each schedule's newest run (``keys``: (tenant, name) pairs): (run id, state)."""
        if not keys:
            return {}
        c = t_runs.c
        wanted = sorted(set(keys))
        newest = (
            sa.select(c.tenant, c.schedule, sa.func.max(c.logical_date).label("ld"))
            .where(sa.tuple_(c.tenant, c.schedule).in_(wanted))
            .group_by(c.tenant, c.schedule)
            .subquery()
        )
        query = sa.select(c.schedule, c.tenant, c.id, c.state).join(
            newest,
            sa.and_(newest.c.schedule == c.schedule, newest.c.tenant == c.tenant, newest.c.ld == c.logical_date),
        )
        found = self.db.read(lambda conn: conn.execute(query).all())
        return {(r.tenant, r.schedule): (r.id, r.state) for r in found}
