"""Keyed flow control in the store (:mod:`orchestrator.core.flow`): a run with a concurrency key is
admitted (its roots start) or held (a RUNNING run whose tasks are all PENDING, ``orc_runs.held``
naming why) by the submit's own transaction, and a held run is released by a compare-and-set on
``held`` (the reconciler's flow pass, :meth:`FlowRows.release`). A ``batch`` run gathers the
key's next submissions (their ``events`` appended to its own, each merged run cancelled). Every
decision about a key is taken under the key's advisory transaction lock, so two submits (or a
submit and the pass) never both take its last slot. Every hold, release, skip, merge and replacement is a row of the
run-level ledger (``orc_task_events``, ``key`` null): an annotation (``held``, ``released``) or the
run's move to CANCELLED with its reason."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.dag.spec import dag_from_spec
from ..core.flow import BATCH_PARAM, FlowControl
from ..core.models import Actor
from ..core.states import FLOW_HELD, FLOW_RELEASED, RunState, TaskState
from . import schema as s
from .database import Database
from .dbtime import db_now
from .ledger import RUN_EVENT_ATTEMPT, Ledger

t_runs, t_tasks = s.runs, s.tasks
SUBMIT, RECONCILER = Actor("submit"), Actor("reconciler")
#: the holds that gather submissions until their instant (not a place in the key's queue)
GATHERING = ("debounce", "batch")
READ = sa.text("SELECT * FROM orc_flow_v1(:tenant, :key, :exclude, :since)")


@dataclass
class Decision:
    """What a submit's flow control did: ``held`` (why, or ``None``: admitted), ``reason`` (the
    ledger's words), ``skipped``, and the admitted runs to cancel once committed (``cancel_running``)."""

    held: str | None = None
    reason: str | None = None
    skipped: bool = False
    cancel: list[str] = field(default_factory=list)


@dataclass
class _Key:
    """A key's runs as read under its lock: admitted ones, held ones (oldest first), recent admissions."""

    active: list[str]
    held: list[Any]
    admitted: list[dt.datetime]


class FlowRows:
    def __init__(self, db: Database, ledger: Ledger, start_roots: Callable[..., None]) -> None:
        self.db = db
        self.ledger = ledger
        self.start_roots = start_roots

    # ------------------------------------------------------------------ submit

    def decide(self, conn: Connection, run_id: str, tenant: str, flow: FlowControl, row: dict[str, Any]) -> Decision:
        """In the submit's transaction, before the run's ``row`` is inserted (its flow columns
        are set here): admit the run (``Decision.held`` None: its roots start) or hold it (every
        task PENDING; :meth:`settle` writes why once the run is written)."""
        now = row["created_at"]  # the transaction's now(), as the database gave it
        key = self._read(conn, tenant, flow, now, exclude=run_id)
        row.update(flow_key=flow.key, flow=flow.to_row(), flow_first_at=now)
        if flow.batch is not None:
            return self._batch(conn, run_id, flow, key, row, now)
        if flow.debounce is not None:
            for prev in key.held:
                if prev.held == "debounce":
                    row["flow_first_at"] = min(row["flow_first_at"], prev.flow_first_at or prev.created_at)
                    self.cancel_held(conn, prev.id, SUBMIT, f"merged into run {run_id} (debounce on key {flow.key})")
            until = now + dt.timedelta(seconds=flow.debounce)
            if flow.max_wait is not None:
                until = min(until, row["flow_first_at"] + dt.timedelta(seconds=flow.max_wait))
            if until > now:
                return _hold(
                    row, "debounce", until, f"debounced until {until.isoformat(timespec='seconds')} (key {flow.key})"
                )
        queued = [r for r in key.held if r.held not in GATHERING]
        if flow.max_concurrent is not None and len(key.active) >= flow.max_concurrent:
            running = f"{len(key.active)} running: {', '.join(key.active)}"
            why = f"held by concurrency key {flow.key} ({running})"
            if flow.on_busy == "skip":  # cancelled by settle() once its tasks are written
                decision = _hold(row, "concurrency", None, f"skipped: concurrency key {flow.key} busy ({running})")
                decision.skipped = True
                return decision
            if flow.on_busy in ("replace_queued", "cancel_running"):  # the new run goes first
                for prev in queued:
                    self.cancel_held(conn, prev.id, SUBMIT, f"replaced by run {run_id} (concurrency key {flow.key})")
            decision = _hold(row, "concurrency", None, why)
            if flow.on_busy == "cancel_running":
                for other in key.active:
                    self.ledger.annotate(
                        conn, other, None, RUN_EVENT_ATTEMPT, RunState.RUNNING.value, SUBMIT, FLOW_HELD,
                        f"to be cancelled: run {run_id} took concurrency key {flow.key} (on_busy=cancel_running)",
                    )  # fmt: skip
                decision.cancel = list(key.active)
            return decision
        if queued:  # first come, first served: behind the runs the key already holds
            why = f"held by concurrency key {flow.key} (behind {len(queued)} held run(s))"
            return _hold(row, queued[0].held, queued[0].held_until, why)
        slot = _next_slot(flow, key.admitted)
        if slot is not None:
            return _hold(
                row, "throttle", slot, f"throttled: next slot at {slot.isoformat(timespec='seconds')} (key {flow.key})"
            )
        row["flow_admitted_at"] = now
        return Decision()

    def _batch(
        self, conn: Connection, run_id: str, flow: FlowControl, key: _Key, row: dict[str, Any], now: Any
    ) -> Decision:
        """``batch=(N, window)``: the submission's events merged into the key's open batch (the
        oldest held ``batch`` run with room: its ``events`` param appended to; the new run is
        cancelled, ``merged into run X``) or a new batch opened (held until the window ends;
        a batch that reaches N is due at once: the flow pass releases it)."""
        assert flow.batch is not None
        most, window = flow.batch
        events, at = batch_events(row["params"]), _event_time(row, now)
        for prev in key.held:
            if prev.held != "batch":
                continue
            found = conn.execute(
                sa.select(t_runs.c.params, t_runs.c.dag_snapshot).where(t_runs.c.id == prev.id).with_for_update()
            ).first()
            have = batch_events(found.params) if found is not None else []
            if found is None or len(have) + len(events) > most or not (prev.held_until and prev.held_until > at):
                continue  # full, or its window is over: the flow pass releases it as it is
            merged = have + events
            params = {**(found.params or {}), BATCH_PARAM: merged}
            values: dict[str, Any] = {"params": params, "dag_snapshot": {**found.dag_snapshot, "params": params}}
            if len(merged) >= most:
                values["held_until"] = now  # full: released by the next flow pass
            conn.execute(t_runs.update().where(t_runs.c.id == prev.id, t_runs.c.held == "batch").values(**values))
            why = f"merged into run {prev.id} (batch on key {flow.key}: {len(merged)} of {most} events)"
            decision = _hold(row, "batch", now, why)
            decision.skipped = True  # cancelled by settle() once its tasks are written
            return decision
        params = {**row["params"], BATCH_PARAM: events}
        row.update(params=params, dag_snapshot={**row["dag_snapshot"], "params": params})
        until = now if len(events) >= most else at + dt.timedelta(seconds=window)
        why = f"batching until {until.isoformat(timespec='seconds')} (key {flow.key}: {len(events)} of {most} events)"
        return _hold(row, "batch", until, why)

    def settle(self, conn: Connection, run_id: str, decision: Decision) -> None:
        """At the end of the submit's transaction: a held run's ``held`` row (why), a skipped one cancelled."""
        if decision.skipped:
            self.cancel_held(conn, run_id, SUBMIT, str(decision.reason))
        elif decision.held is not None:
            state = RunState.RUNNING.value
            self.ledger.annotate(conn, run_id, None, RUN_EVENT_ATTEMPT, state, SUBMIT, FLOW_HELD, str(decision.reason))

    def cancel_held(self, conn: Connection, run_id: str, actor: Actor, reason: str) -> bool:
        """A held run (nothing of it started) RUNNING -> CANCELLED with ``reason``, its tasks
        PENDING -> CANCELLED: compare-and-sets on the run's state and ``held`` (a released run is
        left alone: ``False``)."""
        moved = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id, t_runs.c.state == RunState.RUNNING.value, t_runs.c.held.is_not(None))
            .values(held=None, held_until=None)
            .returning(t_runs.c.id)
        ).first()
        if moved is None:
            return False
        values = {"finished_at": db_now(), "open_tasks": 0}
        self.ledger.move_run(conn, run_id, RunState.RUNNING, RunState.CANCELLED, actor, reason=reason, values=values)
        where = (t_tasks.c.run_id == run_id,)
        self.ledger.move_many(conn, where, TaskState.PENDING, TaskState.CANCELLED, actor, reason=reason)
        return True

    def why_held(self, run_id: str) -> str | None:
        """Why the run is held, as of now (``None``: it is not)."""
        c = t_runs.c
        with self.db.engine.connect() as conn:
            run = conn.execute(
                sa.select(c.tenant, c.flow_key, c.held, c.held_until, c.flow).where(
                    c.id == run_id, c.state == RunState.RUNNING.value
                )
            ).first()
            if run is None or run.held is None:
                return None
            at = run.held_until.isoformat(timespec="seconds") if run.held_until is not None else None
            if run.held == "debounce":
                return f"debounced until {at} (key {run.flow_key})"
            if run.held == "batch":
                return f"batching until {at} (key {run.flow_key})"
            if run.held == "throttle":
                return f"throttled: next slot at {at} (key {run.flow_key})"
            flow = FlowControl.from_row(run.flow_key, run.flow or {})
            active = self._read(conn, run.tenant, flow, None).active
        return f"held by concurrency key {run.flow_key} ({len(active)} running: {', '.join(active)})"

    # ------------------------------------------------------------------ release

    def held_keys(self) -> list[tuple[str, str]]:
        """The (tenant, key) pairs that hold a run the key may release now (``ix_orc_runs_flow_held``)."""
        c = t_runs.c
        with self.db.engine.begin() as conn:
            rows = conn.execute(
                sa.select(c.tenant, c.flow_key)
                .where(
                    c.held.is_not(None),
                    c.state == RunState.RUNNING.value,
                    # a debounce's quiet end or a throttle's slot still ahead: nothing to release yet
                    sa.or_(c.held == "concurrency", c.held_until.is_(None), c.held_until <= db_now()),
                )
                .distinct()
            ).all()
        return [(r.tenant, r.flow_key) for r in rows]

    def release(self) -> int:
        """The reconciler's flow pass: every key that holds runs releases those it may now (a
        freed slot, a throttle's next slot, a debounce's quiet end), oldest first, one transaction
        per key. Returns how many runs were released (their roots READY: the caller admits)."""
        released = 0
        for tenant, key in self.held_keys():
            released += self.db.transaction(partial(self.release_key, tenant=tenant, key_name=key))
        return released

    def release_key(self, conn: Connection, tenant: str, key_name: str) -> int:
        """Release what ``key_name`` may release now, under the key's lock."""
        now = conn.execute(sa.select(db_now())).scalar_one()
        widest = FlowControl(key_name, throttle=(1, 86400.0))
        key = self._read(conn, tenant, widest, now)
        released = 0
        for run in key.held:
            flow = FlowControl.from_row(key_name, run.flow or {})
            if run.held in GATHERING and run.held_until is not None and run.held_until > now:
                continue  # still quiet: it releases when its own instant comes
            if run.held == "batch" and self._unfired(conn, tenant, run.id, run.held_until, flow):
                continue  # its trigger has events of its window still to merge
            if flow.max_concurrent is not None and len(key.active) >= flow.max_concurrent:
                break
            slot = _next_slot(flow, [a for a in key.admitted if flow.throttle and a > now - _period(flow)])
            if slot is not None:
                if run.held != "throttle" or run.held_until != slot:
                    conn.execute(t_runs.update().where(t_runs.c.id == run.id).values(held="throttle", held_until=slot))
                break
            if self._release(conn, run.id, run.held, now, key_name):
                key.active.append(run.id)
                key.admitted.insert(0, now)
                released += 1
        return released

    def _unfired(self, conn: Connection, tenant: str, run_id: str, until: Any, flow: FlowControl) -> bool:
        """Whether the batch run (not full) of a trigger has an open firing (pending, waiting) of
        an event emitted before ``until`` (its window's end): a lagging finisher has not merged it yet."""
        found = conn.execute(sa.select(t_runs.c.trigger, t_runs.c.params).where(t_runs.c.id == run_id)).first()
        if until is None or found is None or found.trigger is None or flow.batch is None:
            return False
        if len(batch_events(found.params)) >= flow.batch[0]:
            return False  # full: released at once
        f = s.trigger_firings.c
        trigger = found.trigger
        query = sa.select(
            sa.exists().where(
                f.tenant == tenant, f.trigger == trigger, f.state.in_(("pending", "waiting")), f.at < until
            )
        )
        return bool(conn.execute(query).scalar())

    def _release(self, conn: Connection, run_id: str, held: str, now: Any, key: str) -> bool:
        """The compare-and-set ``held`` -> null of a RUNNING run, its ``released`` row, its roots started."""
        row = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id, t_runs.c.state == RunState.RUNNING.value, t_runs.c.held == held)
            .values(held=None, held_until=None, flow_admitted_at=now)
            .returning(t_runs.c.dag_snapshot)
        ).first()
        if row is None:
            return False
        why = f"released: concurrency key {key} ({held} hold over)"
        self.ledger.annotate(
            conn, run_id, None, RUN_EVENT_ATTEMPT, RunState.RUNNING.value, RECONCILER, FLOW_RELEASED, why
        )
        self.start_roots(conn, run_id, dag_from_spec(row.dag_snapshot), released=True)
        return True

    def _read(self, conn: Connection, tenant: str, flow: FlowControl, now: Any, exclude: str | None = None) -> _Key:
        """The key's runs, under its lock (``orc_flow_v1``: one round trip)."""
        since = now - dt.timedelta(seconds=flow.throttle[1]) if flow.throttle is not None and now is not None else None
        rows = conn.execute(READ, {"tenant": tenant, "key": flow.key, "exclude": exclude, "since": since}).all()
        active = [r.id for r in rows if r.open and r.held is None]
        held = [r for r in rows if r.open and r.held is not None]
        return _Key(active, held, [r.flow_admitted_at for r in rows if not r.open])


def _hold(row: dict[str, Any], held: str, until: Any, why: str) -> Decision:
    """The run's row held (``held``, ``held_until``) and the decision saying why."""
    row.update(held=held, held_until=until)
    return Decision(held, why)


def batch_events(params: Any) -> list[Any]:
    """A submission's events: its ``events`` param (a list), else its params as one event."""
    params = dict(params or {})
    found = params.get(BATCH_PARAM)
    return list(found) if isinstance(found, list) else [params]


def _event_time(row: dict[str, Any], now: Any) -> Any:
    """When a batched submission's event happened: an event trigger's run has its event's time as
    its logical date (its window is in event time, whatever the finishers' lag); else ``now``."""
    if row.get("trigger") and row.get("logical_date"):
        try:
            return dt.datetime.fromisoformat(row["logical_date"])
        except ValueError:
            pass
    return now


def _period(flow: FlowControl) -> dt.timedelta:
    return dt.timedelta(seconds=flow.throttle[1] if flow.throttle else 0)


def _next_slot(flow: FlowControl, admitted: list[dt.datetime]) -> dt.datetime | None:
    """When the throttle next admits a run of the key (``None``: now). ``admitted``: the key's
    admissions within the period, newest first."""
    if flow.throttle is None or len(admitted) < flow.throttle[0]:
        return None
    return admitted[flow.throttle[0] - 1] + _period(flow)
