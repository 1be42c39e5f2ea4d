"""Scheduling: DAGs fired on a cron expression or an interval, kept in the database.

:class:`Schedules` is ``Orchestrator.schedules`` (:mod:`orchestrator.schedules` has the same
calls as functions on :func:`orchestrator.default`); it adds,
changes, pauses, resumes, triggers, removes and backfills them; ``orchestrator beat`` (celery beat
with :class:`orchestrator.runtime.beat.DatabaseScheduler`) fires them. A change made through the API or
the CLI is seen by a running beat within ``ORCHESTRATOR_BEAT_INTERVAL`` seconds, without a
restart.

What a schedule runs is either a spec (a YAML/JSON file's content snapshotted when the schedule
is added, with its SHA-256, so that a changed file is a visible new version), or a factory
``module:function(logical_date, params) -> DAG`` declared with :func:`dag_factory` in a module of
``ORCHESTRATOR_DAG_FACTORY_MODULES`` (checked when added and again each time it fires: nothing
else is ever imported or called). A schedule fires at most every
``ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS``. Names are unique per tenant. In a spec, string
arguments may hold ``{{ logical_date }}`` (the instant, ISO 8601 UTC) and ``{{ ds }}`` (its date,
YYYY-MM-DD, in the schedule's zone); no other placeholder exists. A task reads its run's logical
date from ``current_context().logical_date``.

Every firing is an ordinary run with ``logical_date`` = the scheduled instant, unique per
(schedule, instant): two beats, a beat restarted mid-firing, or a beat and a backfill never make
two runs for one instant. When it fires and what it does with missed instants and overlapping
runs: :mod:`orchestrator.core.cron` (time zones, DST policy) and :mod:`orchestrator.core.firing`
(catch-up, overlap). A schedule that cannot fire (its factory raises, its spec no longer
validates, the database is out) records ``last_error``, raises the alert hook, and fires again
at its next instant; the others keep firing.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.cron import HORIZON, ScheduleError, Timing, count_instants, instants, last_instants, next_instant
from ..core.dag import (
    DAG,
    MAX_NAME_CHARS,
    dag_from_spec,
    text_problem,
)
from ..core.errors import ConflictError, OrchestratorError, RunNotFound
from ..core.firing import COUNT_MOST, Decision, Policy, looked_at, plan, summary_reason
from ..core.routing import DEFAULT_TENANT
from ..store.schedules import ScheduleRows, iso
from .alerts import raise_alert

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

from .schedule_model import (
    Fired,
    Schedule,
    ScheduleNotFound,
    SchedulerPort,
    _aware,
    _policy,
    _timing,
    _view,
    _when,
    min_interval_problem,
)
from .targets import (
    Target,
    load_factory,
    registered_spec,
    render,
    resolve,
    snapshot,
    spec_hash,
)

log = logging.getLogger(__name__)

#: firings made by a person (``schedule trigger``, ``backfill``): they run a paused DAG, as a
#: submit by hand does
BY_HAND = ("manual", "backfill")
#: firings left pending this long are finished by any beat (the one that wrote them died)
PENDING_AFTER = 15.0
#: the reason of a pending firing whose decision was to cancel the running runs first (overlap
#: cancel_previous): whoever finishes the firing, the beat that decided it or another one, does
CANCEL_PREVIOUS = "overlap cancel_previous: cancel the schedule's running runs first"


class Schedules:
    """The schedules of one orchestrator's deployment (``Orchestrator.schedules``): those of its
    tenant when it is bound to one (``rows`` are scoped to that tenant by the engine)."""

    def __init__(self, orc: SchedulerPort, rows: ScheduleRows) -> None:
        self.orc = orc
        #: the schedules' rows (``Store.schedule_rows``, scoped to the orchestrator's tenant)
        self.rows = rows
        #: schedules (tenant, name) whose part of a pass failed, and when this beat tries them
        #: again (by the database clock): a schedule that fails at once must not spin beat
        self._retry: dict[tuple[str, str], dt.datetime] = {}

    def _of(self, tenant: str) -> ScheduleRows:
        """The rows of ``tenant``'s schedules (what acts on one schedule works through)."""
        return self.rows.scoped(tenant)

    @property
    def _factory_modules(self) -> tuple[str, ...]:
        return tuple(self.orc.settings.dag_factory_modules)

    def _check_interval(self, timing: Timing) -> None:
        least = float(self.orc.settings.schedule_min_interval_seconds)
        problem = min_interval_problem(timing, least)
        if problem:
            raise ScheduleError(problem)

    # ------------------------------------------------------------------ definitions

    def add(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        tz: str = "UTC",
        spec: str | Path | Mapping[str, Any] | DAG | None = None,
        dag: str | None = None,
        registered: str | None = None,
        params: Mapping[str, Any] | None = None,
        dst_gap: str = "shift",
        dst_fold: str = "first",
        catchup: str = "latest",
        max_catchup: int = 10,
        overlap: str = "allow",
        max_active_runs: int | None = None,
        paused: bool | None = None,
    ) -> Schedule:
        """Create the schedule ``name`` or replace its definition. ``spec`` is a spec file's
        path, a parsed spec or a :class:`DAG` (snapshotted now); ``dag`` a factory
        ``module:function`` (its runs are the schedule's tenant's: this orchestrator's, or
        ``default``); ``registered`` a DAG of the registry, ``NAME`` (its latest version each
        time it fires: a re-registration takes effect from the next instant) or ``NAME@N``
        (pinned), of the schedule's tenant. ``paused``: ``None`` keeps a replaced schedule's flag (a new one starts
        unpaused). Raises :class:`ScheduleError` / :class:`ValidationError` naming the problem
        (bad cron, unknown zone, missing spec, unimportable factory, …); nothing is written
        then."""
        problem = text_problem(name, MAX_NAME_CHARS)
        if problem or not isinstance(name, str):
            raise ScheduleError(f"schedule name {problem}")
        timing = Timing(cron=cron, every=every, tz=tz, dst_gap=dst_gap, dst_fold=dst_fold)
        self._check_interval(timing)
        policy = Policy(catchup=catchup, max_catchup=max_catchup, overlap=overlap, max_active_runs=max_active_runs)
        if params is not None and not isinstance(params, Mapping):
            raise ScheduleError("params must be a mapping")
        if paused is not None and not isinstance(paused, bool):
            raise ScheduleError(f"paused must be true or false, not {paused!r}")
        params = dict(params or {})
        if sum(x is not None for x in (spec, dag, registered)) != 1:
            raise ScheduleError(
                "give what to run: a spec, a DAG factory module:function or a registered DAG NAME[@N] (one of them)"
            )
        now = self.rows.now()
        first = next_instant(timing, now)
        if first is None:
            raise ScheduleError(f"{timing.describe()} does not fire within {HORIZON.days // 366} years")
        target = self._target(spec, dag, registered, params, first, timing)
        tenant, snap, factory, ref = target.tenant, target.spec, target.factory, target.registered
        # names are per tenant: another tenant's schedule of that name is another schedule
        rows = self._of(tenant)
        existing = rows.get(name)
        values = _row_values(tenant, timing, policy, snap, factory, ref, params, first)
        values["paused"] = bool(existing.paused) if paused is None and existing is not None else bool(paused)
        changed = existing is None or _timing(existing) != timing
        rows.put(name, values, timing_changed=changed)
        return self._view_of(rows, name)

    def _target(
        self, spec: Any, dag: str | None, registered: str | None, params: dict[str, Any], first: dt.datetime,
        timing: Timing,
    ) -> Target:  # fmt: skip
        """What the schedule runs (:func:`.targets.resolve`), checked as it would fire at its ``first`` instant."""
        return resolve(
            self.orc, spec=spec, dag=dag, registered=registered, factory_modules=self._factory_modules,
            build_spec=lambda snap: self._build_spec(snap, first, timing),
            build_registered=lambda built: self._build_spec(built, first, timing, params), error=ScheduleError,
        )  # fmt: skip

    def _check_registered(
        self, ref: Any, first: dt.datetime, timing: Timing, params: Mapping[str, Any], tenant: str
    ) -> tuple[str, int | None]:
        """``NAME`` or ``NAME@N`` of a registered DAG of ``tenant`` that builds and would submit
        at the schedule's first instant; raises :class:`DagNotFound`, :class:`ValidationError`."""
        found, spec = registered_spec(self.orc, ref, tenant, ScheduleError)
        self.orc.check(self._build_spec(spec, first, timing, params), tenant=tenant)
        return found

    def _snapshot(self, spec: str | Path | Mapping[str, Any] | DAG) -> dict[str, Any]:
        return snapshot(spec, ScheduleError)

    def _row(self, name: str) -> Any:
        """The schedule ``name`` of this orchestrator's tenant; unbound (the deployment's
        operator), of whichever tenant has one so named, and refused as ambiguous when several
        have. Raises :class:`ScheduleNotFound`."""
        found = self.rows.find(name) if isinstance(name, str) else []
        if not found:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        if len(found) > 1:
            tenants = ", ".join(repr(r.tenant) for r in found)
            raise ScheduleError(
                f"schedule name {name!r} is used by the tenants {tenants}: act as one of them (ORCHESTRATOR_TENANT)"
            )
        return found[0]

    def _view_of(self, rows: ScheduleRows, name: str) -> Schedule:
        row = rows.get(name)
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        last = rows.last_runs([(row.tenant, name)]).get((row.tenant, name))
        return _view(row, last)

    def apply(self, path: str | Path) -> list[Schedule]:
        """Upsert every schedule of a YAML/JSON file (:func:`.schedule_files.apply`): every entry
        is checked before any is written."""
        from .schedule_files import apply

        return apply(self, path)

    def get(self, name: str) -> Schedule:
        row = self._row(name)
        last = self.rows.last_runs([(row.tenant, name)]).get((row.tenant, name))
        return _view(row, last)

    def all(self) -> list[Schedule]:
        found = self.rows.all()
        last = self.rows.last_runs([(r.tenant, r.name) for r in found])
        return [_view(r, last.get((r.tenant, r.name))) for r in found]

    def pause(self, name: str) -> Schedule:
        """Stop firing (beat keeps running); instants until :meth:`resume` are missed."""
        rows = self._of(self._row(name).tenant)
        rows.update(name, paused=True)
        return self._view_of(rows, name)

    def resume(self, name: str) -> Schedule:
        """Fire again; the instants missed while paused go through the catch-up policy."""
        current = self.get(name)
        rows = self._of(current.tenant)
        after = current.last_at or rows.now()
        nxt = next_instant(current.timing, after) or rows.now()
        rows.update(name, paused=False, next_at=nxt)
        return self._view_of(rows, name)

    def remove(self, name: str) -> None:
        self._of(self._row(name).tenant).remove(name)

    def firings(self, name: str, limit: int = 100) -> list[Any]:
        """The schedule's newest firings (rows: ``logical_date``, ``state``, ``kind``,
        ``run_id``, ``reason``); raise :class:`ScheduleNotFound`."""
        return self._of(self._row(name).tenant).firings(name, limit)

    def trigger(self, name: str) -> Fired:
        """A manual run now (logical date = now on the database clock), paused or not."""
        current = self.get(name)
        now = self.rows.now()  # one reading of the clock
        at = now.replace(microsecond=now.microsecond // 1000 * 1000)
        return self._fire_one(current, Decision(at, "fire", "manual"), record=True)

    # ------------------------------------------------------------------ firing

    def tick(self) -> float:
        """One pass of the scheduler: fire every schedule that is due; finish firings left
        pending by a beat that died. Returns the seconds until the next instant, at most
        ``ORCHESTRATOR_BEAT_INTERVAL``.

        One schedule's error (other than the database being out) never stops the others: it is
        recorded on that schedule (``last_error``, the alert hook) and the schedule is tried
        again at its next instant (by this beat; any other beat tries on its own pass)."""
        interval = float(self.orc.settings.beat_interval)
        try:
            now = self.rows.now()
            self._retry = {k: at for k, at in self._retry.items() if at > now}
            for tenant, name in self.rows.due(now):
                if (tenant, name) not in self._retry:
                    self._guarded(tenant, name, None, now, partial(self.fire_due, name, tenant=tenant))
            for pending in self.rows.pending(now - dt.timedelta(seconds=PENDING_AFTER)):
                at = _when(pending.logical_date)
                d = Decision(at, "fire", pending.kind, cancel_running=pending.reason == CANCEL_PREVIOUS)
                finish = partial(self._finish_pending, pending.tenant, pending.schedule, d)
                self._guarded(pending.tenant, pending.schedule, d, now, finish)
            soonest = [t for t in (self.rows.next_at(exclude=set(self._retry)), *self._retry.values()) if t]
        except OrchestratorError as exc:
            log.warning("scheduler pass failed: %s", exc)
            return interval
        except Exception as exc:  # the database is out: try again at the next pass
            if not self.orc.is_transient(exc):
                raise
            log.warning("scheduler pass failed (the database is unreachable): %s", exc)
            return interval
        if not soonest:
            return interval
        wait = (min(soonest) - self.rows.now()).total_seconds()
        return max(0.05, min(wait, interval))

    def _guarded(self, tenant: str, name: str, d: Decision | None, now: dt.datetime, fn: Callable[[], Any]) -> None:
        """Run one schedule's part of a pass; an error of its own (not the database being out,
        which ends the pass) is recorded on it, and it waits for its next instant."""
        try:
            fn()
        except Exception as exc:
            if self.orc.is_transient(exc):
                raise
            self._failed(tenant, name, d, f"{type(exc).__name__}: {exc}")
            if d is None:
                self._retry[(tenant, name)] = self._retry_time(tenant, name, now)
        else:
            if d is None:
                self._retry.pop((tenant, name), None)

    def _retry_time(self, tenant: str, name: str, now: dt.datetime) -> dt.datetime:
        """When a schedule whose pass failed is tried again: at its next instant, and not before
        the next beat interval (a schedule that fails at once must not spin beat)."""
        soonest = now + dt.timedelta(seconds=max(float(self.orc.settings.beat_interval), 1.0))
        try:
            row = self._of(tenant).get(name)
            nxt = next_instant(_timing(row), now) if row is not None else None
        except Exception:  # noqa: BLE001 - a timing that does not even parse: the interval
            nxt = None
        return max(soonest, nxt) if nxt is not None else soonest + dt.timedelta(seconds=60)

    def fire_due(self, name: str, *, tenant: str | None = None) -> list[Fired]:
        """Decide the schedule's due instants (under its row lock) and create the runs of
        those that fire. Missed instants cost a bounded amount of work and rows however long
        beat was down: only the newest are looked at one by one (:func:`firing.looked_at`),
        the older ones are counted into one summary firing."""
        grace = self.orc.settings.schedule_grace_seconds
        tiny = dt.timedelta(microseconds=1)
        rows = self._of(tenant if tenant is not None else self._row(name).tenant)

        def decide(conn: Connection, row: Any, now: dt.datetime, running: list[str]) -> list[Decision]:
            if row.paused:
                return []
            timing, policy = _timing(row), _policy(row, grace)
            after = _aware(row.last_at) or _when(row.next_at) - tiny
            wanted = looked_at(policy)
            due = last_instants(timing, after, now, wanted)
            decisions, buffered = plan(due, now, len(running), policy, _aware(row.buffered_at))
            if len(due) == wanted:  # perhaps more, older: one record counts them
                older = count_instants(timing, after, due[0] - tiny, COUNT_MOST)
                oldest = next_instant(timing, after) if older else None
                if oldest is not None and oldest < due[0]:
                    at_least = timing.cron is not None and older >= COUNT_MOST
                    reason = summary_reason(policy, older, at_least, due[0])
                    rows.record(conn, row.name, oldest, "skipped", "catchup", reason=reason, overwrite=False)
            fire = []
            for d in decisions:
                # an instant decided before (a backfill made its run) is left as it is
                if d.action == "fire":
                    intent = CANCEL_PREVIOUS if d.cancel_running else None
                    if rows.record(
                        conn, row.name, d.at, "pending", d.kind, reason=intent, overwrite=d.kind == "buffered"
                    ):
                        fire.append(d)
                else:
                    rows.record(conn, row.name, d.at, "skipped", d.kind, reason=d.reason, overwrite=False)
            last = due[-1] if due else _aware(row.last_at)
            values: dict[str, Any] = {"buffered_at": buffered}
            if due:
                values["last_at"] = last
            values["next_at"] = next_instant(timing, max(now, last) if last else now) or now + HORIZON
            rows.advance(conn, row.name, **values)
            return fire

        fire = rows.decide(name, decide)
        if not fire:
            return []
        row = rows.get(name)
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        current = _view(row, None)
        return [self._fire_one(current, d) for d in fire]

    def _fire_one(self, sched: Schedule, d: Decision, *, record: bool = False) -> Fired:
        """Create the run of one instant (already recorded pending, unless ``record``): build
        and check its DAG first, then (cancel_previous) cancel the older running runs, then
        submit; a DAG that cannot be built or would not submit cancels nothing."""
        logical = iso(d.at)
        rows = self._of(sched.tenant)
        if record:
            intent = CANCEL_PREVIOUS if d.cancel_running else None
            rows.record_pending(sched.name, d.at, d.kind, reason=intent)
        try:
            before = rows.run_for(sched.name, logical, tenant=sched.tenant)
            if before is not None:  # made already: by a backfill, or by a beat that died after it
                run_id = before[0]
            else:
                built, version = self.build_versioned(sched, d.at)
                dag = self.orc.check(built, tenant=sched.tenant)
                if d.kind not in BY_HAND and self.orc.dags.is_paused(dag.name, sched.tenant):
                    # a paused DAG: the instant is decided (skipped), nothing runs, nothing is cancelled
                    reason = f"dag_paused: DAG {dag.name!r} is paused (orchestrator dag unpause {dag.name})"
                    rows.finish(sched.name, d.at, d.kind, skipped=reason, dag_version=version)
                    return Fired(sched.name, d.at, None, False, skipped=reason)
                if d.cancel_running:
                    self._cancel_previous(sched, d.at)
                run_id = self.orc.submit(
                    dag,
                    tenant=sched.tenant,
                    idempotency_key=f"schedule:{sched.name}:{logical}",
                    logical_date=logical,
                    schedule=sched.name,
                    dag_version=version,
                ).id
        except Exception as exc:  # noqa: BLE001 - a broken schedule must never break beat
            if self.orc.is_transient(exc):
                # the database is out: leave the firing pending, any beat finishes it later
                log.warning("schedule %s: firing %s postponed: %s", sched.name, logical, exc)
                return Fired(sched.name, d.at, None, False, error=str(exc))
            error = f"{type(exc).__name__}: {exc}"
            self._failed(sched.tenant, sched.name, d, error)
            return Fired(sched.name, d.at, None, False, error=error)
        rows.finish(sched.name, d.at, d.kind, run_id=run_id, dag_version=before[2] if before else version)
        return Fired(sched.name, d.at, run_id, before is None)

    def _cancel_previous(self, sched: Schedule, at: dt.datetime) -> None:
        """Cancel the schedule's running runs of instants before ``at`` (overlap cancel_previous)."""
        for run in self.rows.running_runs(sched.name, sched.tenant):
            instant = _aware(run.logical_date)
            if instant is not None and instant >= at:
                continue  # a later instant's run (a pending firing finished late): not a previous one
            try:
                self.orc.cancel(run.id, by=f"schedule {sched.name} (overlap cancel_previous)")
            except (ConflictError, RunNotFound):
                pass  # it ended meanwhile

    def _finish_pending(self, tenant: str, name: str, d: Decision) -> None:
        """Finish a firing another beat left pending, with the decision it recorded (its kind,
        and whether to cancel the running runs first)."""
        row = self._of(tenant).get(name)
        if row is None:
            return
        self._fire_one(_view(row, None), d)

    def _failed(self, tenant: str, name: str, d: Decision | None, error: str) -> None:
        log.error("schedule %s could not fire%s: %s", name, f" at {iso(d.at)}" if d else "", error)
        rows = self._of(tenant)
        try:
            if d is not None:
                rows.finish(name, d.at, d.kind, error=error)
            else:
                rows.note_error(name, error)
        except Exception as exc:  # noqa: BLE001 - recording is best effort when the database is out
            log.warning("schedule %s: the error could not be recorded: %s", name, exc)
        alert = {
            "event": "schedule_failed",
            "schedule": name,
            "tenant": tenant,
            "logical_date": iso(d.at) if d else None,
            "error": error,
        }
        raise_alert(alert, webhook=self.orc.settings.alert_webhook or None, actor="scheduler")

    def build(self, sched: Schedule, at: dt.datetime) -> DAG:
        """The DAG a schedule runs for instant ``at``."""
        return self.build_versioned(sched, at)[0]

    def build_versioned(self, sched: Schedule, at: dt.datetime) -> tuple[DAG, int | None]:
        """The DAG a schedule runs for instant ``at`` and, for a registered DAG, the version it
        was built from (the pinned one, or the latest now)."""
        if sched.registered:
            found = self.orc.dags.version(sched.registered, sched.registered_version, tenant=sched.tenant)
            spec = {**(found.spec or {}), "tenant": sched.tenant}
            return self._build_spec(spec, at, sched.timing, sched.params), found.version
        return self._build(sched, at), None

    def _build(self, sched: Schedule, at: dt.datetime) -> DAG:
        if sched.factory:
            # declared and allowed now, by this beat's settings: never call anything else
            made = load_factory(sched.factory, self._factory_modules)(at, dict(sched.params))
            if not isinstance(made, DAG):
                raise ScheduleError(f"factory {sched.factory!r} returned {type(made).__name__}, not a DAG")
            if made.tenant not in (DEFAULT_TENANT, sched.tenant):
                raise ScheduleError(
                    f"factory {sched.factory!r} built a DAG of tenant {made.tenant!r}; schedule {sched.name!r}"
                    f" runs as tenant {sched.tenant!r}"
                )
            return made
        assert sched.spec is not None
        return self._build_spec(sched.spec, at, sched.timing, sched.params)

    @staticmethod
    def _build_spec(spec: Mapping[str, Any], at: dt.datetime, timing: Timing, params: Mapping[str, Any] = {}) -> DAG:
        rendered = render(dict(spec), at, timing.zone)
        if params:
            rendered["params"] = {**rendered.get("params", {}), **params}
        return dag_from_spec(rendered)

    # ------------------------------------------------------------------ backfill

    def backfill_dates(self, name: str, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
        """The schedule's instants in ``[start, end)``, oldest first."""
        sched = self.get(name)
        if end <= start:
            raise ScheduleError(f"the backfill's end {iso(end)} must be after its start {iso(start)}")
        tiny = dt.timedelta(microseconds=1)
        return list(instants(sched.timing, start - tiny, end - tiny))

    def backfill(
        self,
        name: str,
        start: dt.datetime,
        end: dt.datetime,
        *,
        max_active: int = 4,
        poll: float = 0.2,
        timeout: float | None = None,
    ) -> Iterator[Fired]:
        """Create a run for every instant in ``[start, end)`` that has none, oldest first, with at
        most ``max_active`` runs of the schedule RUNNING at once; yields each instant's outcome.
        Idempotent with the scheduler and with itself: run it again after an interruption and it
        creates only what is missing."""
        if isinstance(max_active, bool) or not isinstance(max_active, int) or max_active < 1:
            raise ScheduleError(f"max_active must be an integer of at least 1, not {max_active!r}")
        sched = self.get(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        rows = self._of(sched.tenant)
        for at in self.backfill_dates(name, start, end):
            found = rows.run_for(name, iso(at), tenant=sched.tenant)
            if found is not None:
                yield Fired(name, at, found[0], False)
                continue
            while len(rows.running_runs(name, sched.tenant)) >= max_active:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"backfill of {name}: no room under --max-active {max_active} in time")
                time.sleep(poll)
            yield self._fire_one(sched, Decision(at, "fire", "backfill"), record=True)


def _row_values(
    tenant: str, timing: Timing, policy: Policy, snapshot: dict[str, Any] | None, factory: str | None,
    ref: tuple[str, int | None] | None, params: dict[str, Any], first: dt.datetime,
) -> dict[str, Any]:  # fmt: skip
    """A schedule's row as :meth:`Schedules.add` writes it (its ``paused`` flag aside)."""
    return {
        "tenant": tenant,
        "cron": timing.cron,
        "every_seconds": timing.every,
        "timezone": timing.tz,
        "dst_gap": timing.dst_gap,
        "dst_fold": timing.dst_fold,
        "catchup": policy.catchup,
        "max_catchup": policy.max_catchup,
        "overlap": policy.overlap,
        "max_active_runs": policy.max_active_runs,
        "spec": snapshot,
        "spec_hash": spec_hash(snapshot) if snapshot is not None else None,
        "factory": factory,
        "registered": ref[0] if ref else None,
        "registered_version": ref[1] if ref else None,
        "params": params,
        "next_at": first,
    }
