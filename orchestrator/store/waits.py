"""Waits and events (``store/sql/wait.sql``): emit an event or a signal and wake what waits for
it, defer a running body, answer an approval, wake the waits that are due, prune old events.

Every wake is ``orc_wake_v1``'s compare-and-set on the WAITING row's attempt, in the transaction
that wrote the event (or found the wait due), so an event is matched exactly once against the
waits that exist when it commits, and a wait that begins after it finds it by looking back
(``orc_wait_v1``): the emitter and the waiter serialise on the event key's advisory lock.
What a wake made READY is admitted in the same transaction; the caller publishes the returned
dispatches after the commit.

The advisory lock is the tenant's (``orc_event_lock_v1``): one tenant's submits and emits never
wait on another's. An emit's statements are bounded (``ORCHESTRATOR_EMIT_TIMEOUT_SECONDS``), and so is each
match (``waits.MAX_MATCH_BYTES``, ``MAX_MATCH_ITEMS``), so one emit cannot hold a server process
for long whatever its tenant's waits hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.errors import EmitTimeout, EventIdConflict, OperatorError, RunNotFound, TaskNotFound
from ..core.models import Dispatch
from ..core.states import TaskState as T
from . import schema as s
from .admission import Admission
from .database import Database
from .shards import Fence, hold, refuse_tasks
from .triggers import record_firings

t_tasks, t_runs, t_emitted = s.tasks, s.runs, s.emitted

_EMIT = sa.text("SELECT orc_emit_v1(:tenant, :key, CAST(:payload AS jsonb), :event_id, :run, :by)").bindparams(
    sa.bindparam("payload", type_=sa.String)
)
#: an emit's statement bound (``SET LOCAL``: this transaction's statements only)
_BOUND = sa.text("SELECT set_config('statement_timeout', :ms, true)")
#: query_canceled: a statement ran past its statement_timeout
_CANCELED = "57014"
#: the reconciler's pass over the waits due; with ``mine``, those of the runs of its shards only
_WAKE_DUE = sa.text("SELECT orc_wake_due_v2(:limit, 'reconciler', :shards, CAST(:mine AS integer[]))")
_DEFER = sa.text("SELECT orc_defer_v1(:run, :key, :attempt, CAST(:spec AS jsonb), 'worker')")
_WAKE = sa.text("SELECT orc_wake_v1(:run, :key, :attempt, :how, CAST(:payload AS jsonb), 'operator', :by, :reason)")


@dataclass(frozen=True)
class Emitted:
    """What an emit did: the event's row id, whether its ``event_id`` was seen before (then it
    woke nothing), how many waiting tasks it woke and the dispatches to publish."""

    id: int
    event_id: str
    duplicate: bool
    woken: int
    dispatches: list[Dispatch]


def _reused(tenant: str, event_id: str, key: str, run_id: str | None, out: dict[str, Any]) -> str:
    """What differs between a reused event id's first event and this one, in words."""
    first = f"a signal to run {out['run']}" if out["run"] is not None else "an event (to no run)"
    differs = {
        "key": f"with the key {out['key']!r}, not {key!r}",
        "run": f"as {first}, not " + (f"a signal to run {run_id}" if run_id is not None else "an event"),
        "payload": "with another payload",
    }[out["conflict"]]
    return (
        f"event id {event_id!r} of tenant {tenant!r} was emitted before {differs}; nothing was written (a new event"
        " needs a new event_id; the same key and payload again is answered as a duplicate)"
    )


class Waits:
    def __init__(self, db: Database, admission: Admission) -> None:
        self.db = db
        self.admission = admission

    def emit(
        self, tenant: str, key: str, payload_json: str, event_id: str, run_id: str | None, by: str | None, window: int,
        timeout: float = 0.0,
    ) -> Emitted:  # fmt: skip
        """Write the event and wake its waits (``orc_emit_v1``), then admit what they made READY.
        An ``event_id`` the tenant emitted before is a duplicate (nothing woken again) when it
        came with the same key, payload and run; else :class:`EventIdConflict`. Raises
        :class:`EmitTimeout` when a statement of it runs past ``timeout`` seconds (0: no
        bound). Nothing is written when it raises."""

        def tx(conn: Connection) -> Emitted:
            if timeout > 0:
                conn.execute(_BOUND, {"ms": str(max(1, round(timeout * 1000)))})
            out = conn.execute(
                _EMIT,
                {"tenant": tenant, "key": key, "payload": payload_json, "event_id": event_id, "run": run_id, "by": by},
            ).scalar_one()
            if out.get("conflict"):
                raise EventIdConflict(_reused(tenant, event_id, key, run_id, out), event_id=event_id, id=int(out["id"]))
            if run_id is None and not out["duplicate"]:  # the event triggers' firings, with the event
                record_firings(conn, tenant, key, payload_json, int(out["id"]))
            dispatches = self.admission.admit(conn, window) if out["readied"] else []
            return Emitted(int(out["id"]), event_id, bool(out["duplicate"]), int(out["woken"]), dispatches)

        try:
            return self.db.transaction(tx)
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != _CANCELED or "statement timeout" not in str(exc.orig):
                raise
            raise EmitTimeout(
                f"emit of {key!r} for tenant {tenant!r} ran past its bound of {timeout:g} s"
                " (ORCHESTRATOR_EMIT_TIMEOUT_SECONDS) matching and waking the waits and triggers on that key; nothing"
                " was written (emit it again, or make those waits fewer or their matches smaller)"
            ) from None

    def defer(
        self, run_id: str, key: str, attempt: int, spec_json: str, window: int
    ) -> tuple[bool, str | None, list[Dispatch]]:
        """RUNNING -> WAITING for ``attempt`` (``orc_defer_v1``); the slot it held goes to other
        READY work at once. Returns (accepted, conflict, dispatches)."""

        def tx(conn: Connection) -> tuple[bool, str | None, list[Dispatch]]:
            out = conn.execute(_DEFER, {"run": run_id, "key": key, "attempt": attempt, "spec": spec_json}).scalar_one()
            if not out["accepted"]:
                return False, out.get("conflict"), []
            return True, None, self.admission.admit(conn, window)

        return self.db.transaction(tx)

    def answer(
        self, run_id: str, key: str, how: str, payload_json: str, by: str, reason: str, window: int, tenant: str | None
    ) -> list[Dispatch]:
        """A person's answer to an approval node (``approve`` / ``reject``), or an operator's end
        of any wait: the task must be WAITING for an approval (any wait, for ``how`` ``skip``).
        Raises :class:`RunNotFound`, :class:`TaskNotFound`, :class:`OperatorError`; nothing is
        written then."""

        def tx(conn: Connection) -> list[Dispatch]:
            where = [t_runs.c.id == run_id] + ([t_runs.c.tenant == tenant] if tenant is not None else [])
            if conn.execute(sa.select(t_runs.c.id).where(*where)).first() is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            row = conn.execute(
                sa.select(t_tasks.c.state, t_tasks.c.attempt, t_tasks.c.waiting)
                .where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
                .with_for_update()
            ).first()
            if row is None:
                raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
            kind = (row.waiting or {}).get("kind")
            if row.state != T.WAITING.value or kind != "approval":
                held = f"{row.state}" + (f" (waiting for {kind})" if kind and kind != "approval" else "")
                raise OperatorError(f"task {key!r} of run {run_id} is not waiting for an approval: it is {held}")
            conn.execute(
                _WAKE,
                {"run": run_id, "key": key, "attempt": row.attempt, "how": how, "payload": payload_json, "by": by,
                 "reason": reason},
            )  # fmt: skip
            return self.admission.admit(conn, window)

        return self.db.transaction(tx)

    def wake_due(self, limit: int, fence: Fence | None = None) -> int:
        """The reconciler's pass: wake (or time out) at most ``limit`` waits due; what they made
        READY is admitted by the reconciler's admission that follows. Returns how many.

        With ``fence`` (the sharded reconciler): the waits of the runs of the shards it still
        holds at the epochs it read (locked ``FOR SHARE`` in this transaction), each woken by
        ``orc_wake_due_v2`` with those shards; the waits due in a shard that moved get a rejected
        ledger row naming the stale epoch instead."""

        def tx(conn: Connection) -> int:
            if fence is None:
                woken = conn.execute(_WAKE_DUE, {"limit": limit, "shards": None, "mine": None}).scalar_one()
                return int(woken["woken"])
            valid, refused = hold(conn, fence)
            if refused:
                due = (t_tasks.c.state == T.WAITING.value, t_tasks.c.wake_at <= sa.func.now())
                refuse_tasks(conn, fence, refused, due, T.READY.value)
            if not valid:
                return 0
            woken = conn.execute(_WAKE_DUE, {"limit": limit, "shards": fence.shards, "mine": list(valid)}).scalar_one()
            return int(woken["woken"])

        return self.db.transaction(tx)

    def prune_events(self, older_than_seconds: float, limit: int = 10_000) -> int:
        """Delete events older than the retention (at most ``limit`` per call, oldest first)."""

        def tx(conn: Connection) -> int:
            old = (
                sa.select(t_emitted.c.id)
                .where(
                    t_emitted.c.emitted_at < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, older_than_seconds)
                )
                .order_by(t_emitted.c.emitted_at)
                .limit(limit)
                .scalar_subquery()
            )
            return int(conn.execute(t_emitted.delete().where(t_emitted.c.id.in_(old))).rowcount or 0)

        return self.db.transaction(tx)

    def events(self, tenant: str | None, key: str | None = None, limit: int = 100) -> list[Any]:
        """The newest events (of ``tenant``; of ``key``), newest first."""
        query = sa.select(t_emitted).order_by(t_emitted.c.id.desc()).limit(limit)
        if tenant is not None:
            query = query.where(t_emitted.c.tenant == tenant)
        if key is not None:
            query = query.where(t_emitted.c.key == key)
        return list(self.db.read(lambda conn: conn.execute(query).all()))
