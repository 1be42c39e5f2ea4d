"""Event triggers (``orc_triggers``) and their firings (``orc_trigger_firings``).

A firing is written ``pending`` by the emit itself, in the event's transaction
(:meth:`orchestrator.store.waits.Waits.emit`, :data:`RECORD`): an event that committed has its
firings, whoever finishes them. Finishing one (:meth:`TriggerRows.finish`) happens under the
trigger's row lock (``FOR UPDATE``): the firing is read again (another finisher may have done
it), the trigger's RUNNING runs are counted against its ``max_active_runs``, and the run is made
with the idempotency key ``on:TRIGGER:EVENT_ID`` (unique per DAG and tenant), so two finishers
racing, or a finisher that died between the run and the firing's update, still make one run.

A trigger is keyed by (tenant, name), as a schedule is; :class:`TriggerRows` may be scoped to a
tenant (:meth:`TriggerRows.scoped`): every query then carries ``tenant = :tenant``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from ..core.errors import ValidationError
from ..core.states import RunState
from . import schema as s
from .database import Database
from .dbtime import aware, db_now

t_triggers, t_firings, t_runs, t_events = s.triggers, s.trigger_firings, s.runs, s.emitted

#: the firings of a tenant-wide event, written in the emit's transaction (``Waits.emit``): one
#: ``pending`` row per trigger of the tenant on the event's key that is not paused and whose
#: match the payload contains
RECORD = sa.text(
    "INSERT INTO orc_trigger_firings (tenant, trigger, event, state, at)"
    " SELECT tr.tenant, tr.name, :event, 'pending', now() FROM orc_triggers tr"
    " WHERE tr.tenant = :tenant AND tr.event_key = :key AND NOT tr.paused"
    " AND (tr.match IS NULL OR CAST(:payload AS jsonb) @> tr.match)"
    " ON CONFLICT DO NOTHING"
).bindparams(sa.bindparam("payload", type_=sa.String))

#: the states of a firing still to be finished
OPEN = ("pending", "waiting")


def record_firings(conn: Connection, tenant: str, key: str, payload_json: str, event: int) -> None:
    """Within the emit's transaction: the firings of the new tenant-wide event ``event``."""
    conn.execute(RECORD, {"tenant": tenant, "key": key, "payload": payload_json, "event": event})


def idempotency_key(trigger: str, event_id: str) -> str:
    """The run's idempotency key for one (trigger, event): one run, however many finishers."""
    return f"on:{trigger}:{event_id}"


class TriggerRows:
    def __init__(self, db: Database, *, tenant: str | None = None) -> None:
        self.db = db
        #: the tenant whose triggers these rows are (``None``: every tenant's)
        self.tenant = tenant

    def scoped(self, tenant: str | None) -> TriggerRows:
        """These rows as ``tenant`` sees them (``None``: every tenant's)."""
        return self if tenant == self.tenant else TriggerRows(self.db, tenant=tenant)

    def _owner(self) -> str:
        if self.tenant is None:
            raise RuntimeError("trigger rows must be scoped to the trigger's tenant to change it")
        return self.tenant

    def _mine(self, *where: Any) -> list[Any]:
        found = list(where)
        if self.tenant is not None:
            found.append(t_triggers.c.tenant == self.tenant)
        return found

    def _key(self, name: str) -> list[Any]:
        return [t_triggers.c.name == name, t_triggers.c.tenant == self._owner()]

    # ------------------------------------------------------------------ definitions

    def put(self, name: str, values: dict[str, Any]) -> bool:
        """Create the trigger (of ``values['tenant']``) or replace its definition; returns
        whether it was new."""
        tenant = values["tenant"]
        if self.tenant is not None and tenant != self.tenant:
            raise ValidationError(f"these triggers are tenant {self.tenant!r}'s")
        if values.get("match") is None:  # SQL NULL (matches every payload), not JSON null
            values = {**values, "match": sa.null()}
        key = (t_triggers.c.name == name, t_triggers.c.tenant == tenant)

        def tx(conn: Connection) -> bool:
            now = db_now()
            inserted = conn.execute(
                postgresql.insert(t_triggers)
                .values(name=name, created_at=now, updated_at=now, **values)
                .on_conflict_do_nothing(index_elements=[t_triggers.c.tenant, t_triggers.c.name])
                .returning(t_triggers.c.name)
            ).first()
            if inserted is not None:
                return True
            conn.execute(t_triggers.update().where(*key).values(updated_at=now, **values))
            return False

        return self.db.transaction(tx)

    def get(self, name: str) -> Any:
        query = sa.select(t_triggers).where(*self._mine(t_triggers.c.name == name)).order_by(t_triggers.c.tenant)
        return self.db.read(lambda conn: conn.execute(query).first())

    def find(self, name: str) -> list[Any]:
        """Every trigger called ``name`` these rows see (scoped: at most one)."""
        query = sa.select(t_triggers).where(*self._mine(t_triggers.c.name == name)).order_by(t_triggers.c.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def all(self) -> list[Any]:
        query = sa.select(t_triggers).where(*self._mine()).order_by(t_triggers.c.name, t_triggers.c.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def update(self, name: str, **values: Any) -> bool:
        def tx(conn: Connection) -> bool:
            query = t_triggers.update().where(*self._key(name)).values(updated_at=db_now(), **values)
            return bool(conn.execute(query).rowcount)

        return self.db.transaction(tx)

    def note_error(self, name: str, error: str | None) -> None:
        """Keep (or, ``None``, clear) the trigger's last error."""
        self.update(name, last_error=error, last_error_at=db_now() if error is not None else None)

    def remove(self, name: str) -> bool:
        """Delete the trigger and its firings (its runs stay)."""

        def tx(conn: Connection) -> bool:
            mine = conn.execute(sa.select(t_triggers.c.name).where(*self._key(name)).with_for_update()).first()
            if mine is None:
                return False
            conn.execute(t_firings.delete().where(t_firings.c.tenant == self._owner(), t_firings.c.trigger == name))
            return bool(conn.execute(t_triggers.delete().where(*self._key(name))).rowcount)

        return self.db.transaction(tx)

    # ------------------------------------------------------------------ firings

    def firings(self, name: str, limit: int = 100) -> list[Any]:
        """The trigger's newest firings (of these rows' tenant), with the event's key and id."""
        c = t_firings.c
        query = (
            sa.select(t_firings, t_events.c.event_id, t_events.c.emitted_at)
            .select_from(t_firings.outerjoin(t_events, t_events.c.id == c.event))
            .where(c.trigger == name)
            .order_by(c.event.desc())
            .limit(limit)
        )
        if self.tenant is not None:
            query = query.where(c.tenant == self.tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def of_event(self, event: int) -> list[tuple[str, str]]:
        """The (tenant, trigger) firings of the event row ``event`` still to be finished."""
        c = t_firings.c
        query = sa.select(c.tenant, c.trigger).where(c.event == event, c.state.in_(OPEN)).order_by(c.trigger)
        if self.tenant is not None:
            query = query.where(c.tenant == self.tenant)
        return [(r.tenant, r.trigger) for r in self.db.read(lambda conn: conn.execute(query).all())]

    def open(self, limit: int = 1000) -> list[tuple[str, str, int]]:
        """Firings still to be finished (pending: their finisher died or has not come yet;
        waiting: for room under max_active_runs), as (tenant, trigger, event), oldest first."""
        c = t_firings.c
        query = sa.select(c.tenant, c.trigger, c.event).where(c.state.in_(OPEN)).order_by(c.event).limit(limit)
        if self.tenant is not None:
            query = query.where(c.tenant == self.tenant)
        return [(r.tenant, r.trigger, r.event) for r in self.db.read(lambda conn: conn.execute(query).all())]

    def open_of(self, tenant: str, name: str, upto: int, limit: int = 100) -> list[int]:
        """The trigger's open firings of events up to ``upto``, oldest first (event row ids)."""
        c = t_firings.c
        query = (
            sa.select(c.event)
            .where(c.tenant == tenant, c.trigger == name, c.event <= upto, c.state.in_(OPEN))
            .order_by(c.event)
            .limit(limit)
        )
        return [r.event for r in self.db.read(lambda conn: conn.execute(query).all())]

    @staticmethod
    def running(conn: Connection, name: str, tenant: str) -> int:
        """How many of the trigger's runs are RUNNING (``ix_orc_runs_trigger_state``)."""
        c = t_runs.c
        query = sa.select(sa.func.count()).where(
            c.trigger == name, c.tenant == tenant, c.state == RunState.RUNNING.value
        )
        return int(conn.execute(query).scalar_one())

    def run_of(self, conn: Connection, name: str, tenant: str, event_id: str) -> str | None:
        """The run a finisher already made for (trigger, event), if any."""
        c = t_runs.c
        query = sa.select(c.id).where(
            c.trigger == name, c.tenant == tenant, c.idempotency_key == idempotency_key(name, event_id)
        )
        return conn.execute(query.limit(1)).scalar()

    def finish(self, tenant: str, name: str, event: int, fn: Callable[[Any, Any, int, bool], Any]) -> Any:
        """Under the trigger's row lock, with the firing (still open) and its event:
        ``fn(trigger_row, event_row, running, older)`` (``running``: the trigger's RUNNING runs;
        ``older``: whether an older firing of the trigger is still open) makes the run and
        returns ``(state, run_id, reason, dag_version)`` for the firing, which is written then.
        Returns what was written, or ``None`` when there was nothing to do (finished by another,
        trigger gone)."""
        scoped = self.scoped(tenant)

        def tx(conn: Connection) -> Any:
            row = conn.execute(sa.select(t_triggers).where(*scoped._key(name)).with_for_update()).first()
            key = (t_firings.c.tenant == tenant, t_firings.c.trigger == name, t_firings.c.event == event)
            firing = conn.execute(sa.select(t_firings).where(*key).with_for_update()).first()
            if row is None or firing is None or firing.state not in OPEN:
                return None
            found = conn.execute(sa.select(t_events).where(t_events.c.id == event)).first()
            outcome: tuple[str, str | None, str | None, int | None]
            if found is None:
                outcome = ("failed", None, "the event was pruned before its run could start", None)
            else:
                done = self.run_of(conn, name, tenant, found.event_id)
                if done is not None:  # a finisher that died after making the run
                    outcome = ("fired", done, None, firing.dag_version)
                else:
                    older = conn.execute(
                        sa.select(
                            sa.exists().where(
                                t_firings.c.tenant == tenant, t_firings.c.trigger == name,
                                t_firings.c.event < event, t_firings.c.state.in_(OPEN),
                            )
                        )
                    ).scalar()  # fmt: skip
                    outcome = fn(row, found, self.running(conn, name, tenant), bool(older))
            state, run_id, reason, version = outcome
            conn.execute(
                t_firings.update()
                .where(*key)
                .values(state=state, run_id=run_id, reason=reason, dag_version=version, at=db_now())
            )
            if state == "fired":
                conn.execute(t_triggers.update().where(*scoped._key(name)).values(last_error=None, last_error_at=None))
            elif state == "failed":
                conn.execute(
                    t_triggers.update().where(*scoped._key(name)).values(last_error=reason, last_error_at=db_now())
                )
            return outcome

        return self.db.transaction(tx)

    def last_runs(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[str, str]]:
        """Each trigger's newest run (``keys``: (tenant, name) pairs): (run id, state)."""
        if not keys:
            return {}
        c = t_runs.c
        newest = (
            sa.select(c.tenant, c.trigger, sa.func.max(c.created_at).label("at"))
            .where(sa.tuple_(c.tenant, c.trigger).in_(sorted(set(keys))))
            .group_by(c.tenant, c.trigger)
            .subquery()
        )
        query = sa.select(c.trigger, c.tenant, c.id, c.state).join(
            newest, sa.and_(newest.c.trigger == c.trigger, newest.c.tenant == c.tenant, newest.c.at == c.created_at)
        )
        found = self.db.read(lambda conn: conn.execute(query).all())
        return {(r.tenant, r.trigger): (r.id, r.state) for r in found}

    def now(self) -> dt.datetime:
        value = self.db.read(lambda conn: conn.execute(sa.select(db_now())).scalar_one())
        found = aware(value)
        assert found is not None
        return found
