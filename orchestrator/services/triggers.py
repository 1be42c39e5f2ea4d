"""Event triggers: a DAG started by an event, kept in the database.

:class:`Triggers` is ``Orchestrator.triggers``; ``orchestrator on ...`` is its command line. A
trigger names an event key of its tenant, an optional ``match`` (a JSON object the event's
payload must contain, as a wait's match: JSON containment, data never code), and what to run,
as a schedule does: a spec snapshotted when the trigger is added (with its SHA-256), a factory
``module:function(logical_date, params) -> DAG`` declared with :func:`~orchestrator.dag_factory`
in a module of ``ORCHESTRATOR_DAG_FACTORY_MODULES`` (checked when added and again each time it
fires), or a registered DAG ``NAME[@N]``.

Each event of the key (emitted for the tenant, not a signal to a run) whose payload matches
starts one run: the event's payload laid over the trigger's ``params``, laid over the DAG's
params; the run's logical date is the event's time (a factory is called with it, a spec's
``{{ logical_date }}`` / ``{{ ds }}`` are filled with it, in UTC), its ``trigger`` column names
the trigger and its idempotency key is ``on:TRIGGER:EVENT_ID``.

Exactly one run per (trigger, event), with any number of emitters, beats and web servers: the
firing rows are written by the emit, in the event's transaction (``pending``), so an event that
committed has them; then whoever finds one finishes it under the trigger's row lock (the
emitter right after its commit, any ``orchestrator beat`` on each pass: :meth:`Triggers.tick`).
With ``max_active_runs`` and that many of the trigger's runs RUNNING, a firing is left
``waiting`` and fires, in event order, on a later pass once a run ended: never dropped. A paused
trigger records no firing for the events emitted while it is paused (they are not replayed on
resume). A registered DAG that is paused skips the firing (``skipped``, with the reason). A
firing that cannot start its run (the factory raises, the spec no longer validates) is
``failed``: the trigger keeps it as ``last_error`` and the alert hook is raised.

With ``batch=(100, "5s")`` the events are gathered instead: each firing submits its run with
``events=[payload]`` (the trigger's ``params`` beside it) under the concurrency key
``trigger:NAME`` with keyed flow control's ``batch`` (:mod:`orchestrator.core.flow`): the first
event opens a held run, the next ones (up to 100, within 5 s of the first) are merged into its
``events`` list (each merged run CANCELLED, ``merged into run X``), and the reconciler's flow pass
starts it when it is full or its window is over.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.dag import (
    DAG,
    MAX_NAME_CHARS,
    check_json,
    dag_from_spec,
    parse_spec,
    read_spec_text,
    text_problem,
)
from ..core.errors import OrchestratorError, SpecError, ValidationError
from ..core.flow import BATCH_PARAM, KEY_RE, FlowControlError, parse_batch
from ..core.routing import DEFAULT_TENANT
from ..core.waits import check_event_key, check_match
from ..store.schedules import iso
from ..store.triggers import TriggerRows, idempotency_key
from .alerts import raise_alert
from .targets import load_factory, render, resolve, snapshot, spec_hash

if TYPE_CHECKING:
    from ..core.config import Settings
    from .dag_registry import DagRegistry

log = logging.getLogger(__name__)


class TriggerError(ValidationError):
    """A trigger's definition is malformed (nothing is written)."""


class TriggerNotFound(OrchestratorError):
    """No trigger has the given name (for this tenant)."""


@dataclass(frozen=True)
class Trigger:
    """An event trigger as stored (read-only view)."""

    name: str
    tenant: str
    event: str
    match: dict[str, Any] | None
    spec: dict[str, Any] | None
    spec_hash: str | None
    factory: str | None
    registered: str | None
    registered_version: int | None
    params: dict[str, Any]
    max_active_runs: int | None
    paused: bool
    batch: tuple[int, float] | None = None
    last_error: str | None = None
    last_error_at: dt.datetime | None = None
    last_run_id: str | None = None
    last_run_state: str | None = None

    @property
    def what(self) -> str:
        if self.factory:
            return f"factory {self.factory}"
        if self.registered:
            pinned = f"@{self.registered_version}" if self.registered_version is not None else " (latest)"
            return f"registered {self.registered}{pinned}"
        name = (self.spec or {}).get("name", "?")
        return f"spec {name} ({(self.spec_hash or '')[:12]})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tenant": self.tenant,
            "event": self.event,
            "match": self.match,
            "runs": self.what,
            "spec_hash": self.spec_hash,
            "factory": self.factory,
            "registered": self.registered,
            "registered_version": self.registered_version,
            "params": self.params,
            "max_active_runs": self.max_active_runs,
            "batch": list(self.batch) if self.batch else None,
            "paused": self.paused,
            "last_run": self.last_run_id,
            "last_run_state": self.last_run_state,
            "last_error": self.last_error,
            "last_error_at": iso(self.last_error_at) if self.last_error_at else None,
        }


@dataclass(frozen=True)
class Firing:
    """What finishing one (trigger, event) did: ``state`` fired (with the run), waiting (at
    max_active_runs), skipped (the DAG is paused) or failed (with the error); ``None`` state:
    nothing to do (another finisher did it)."""

    trigger: str
    event: int
    state: str | None
    run_id: str | None = None
    reason: str | None = None


class _Submitted(Protocol):
    @property
    def id(self) -> str: ...


class TriggerPort(Protocol):
    """What :class:`Triggers` needs of its orchestrator (an
    :class:`~orchestrator.engine.facade.Orchestrator`; a Protocol, so that this module does not import
    the engine back)."""

    @property
    def tenant(self) -> str | None: ...

    @property
    def settings(self) -> Settings: ...

    def check(self, dag: DAG, *, tenant: str | None = None) -> DAG: ...

    def submit(
        self,
        dag: DAG,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        logical_date: str | None = None,
        schedule: str | None = None,
        dag_version: int | None = None,
        trigger: str | None = None,
        concurrency_key: str | None = None,
        batch: Any = None,
    ) -> _Submitted: ...

    @property
    def dags(self) -> DagRegistry: ...

    def is_transient(self, exc: BaseException) -> bool: ...


_ALLOWED = {"name", "event", "match", "spec", "dag", "registered", "params", "max_active_runs", "paused", "batch"}


class Triggers:
    """The event triggers of one orchestrator's deployment (``Orchestrator.triggers``): those of
    its tenant when it is bound to one."""

    def __init__(self, orc: TriggerPort, rows: TriggerRows) -> None:
        self.orc = orc
        #: the triggers' rows (``Store.triggers``, scoped to the orchestrator's tenant)
        self.rows = rows

    def _of(self, tenant: str) -> TriggerRows:
        return self.rows.scoped(tenant)

    @property
    def _factory_modules(self) -> tuple[str, ...]:
        return tuple(self.orc.settings.dag_factory_modules)

    # ------------------------------------------------------------------ definitions

    def add(
        self,
        name: str,
        *,
        event: str,
        match: Mapping[str, Any] | None = None,
        spec: str | Path | Mapping[str, Any] | DAG | None = None,
        dag: str | None = None,
        registered: str | None = None,
        params: Mapping[str, Any] | None = None,
        max_active_runs: int | None = None,
        paused: bool | None = None,
        batch: Any = None,
    ) -> Trigger:
        """Create the trigger ``name`` or replace its definition: each event ``event`` of its
        tenant whose payload contains ``match`` starts a run of ``spec`` (a spec file's path, a
        parsed spec or a :class:`DAG`, snapshotted now), ``dag`` (a factory ``module:function``)
        or ``registered`` (``NAME`` or ``NAME@N``). ``paused``: ``None`` keeps a replaced
        trigger's flag (a new one starts unpaused). ``batch=(100, "5s")``: up to 100 events, or
        5 s from the first, make one run whose ``events`` param lists their payloads. Raises :class:`TriggerError` /
        :class:`ValidationError` naming the problem; nothing is written then."""
        tenant, values = self._prepare(
            name, event, match, spec, dag, registered, params, max_active_runs, paused, batch=batch
        )
        rows = self._of(tenant)
        existing = rows.get(name)
        values["paused"] = bool(existing.paused) if paused is None and existing is not None else bool(paused)
        rows.put(name, values)
        return self._view_of(rows, name)

    def _prepare(
        self,
        name: Any,
        event: Any,
        match: Any,
        spec: Any,
        dag: Any,
        registered: Any,
        params: Any,
        max_active_runs: Any,
        paused: Any,
        *,
        batch: Any = None,
    ) -> tuple[str, dict[str, Any]]:
        """Check a definition (building its DAG as it would fire now, with no payload) and
        return (tenant, the row's values); writes nothing."""
        problem = text_problem(name, MAX_NAME_CHARS) if isinstance(name, str) else "must be a string"
        if problem:
            raise TriggerError(f"trigger name {problem}")
        check_event_key(event)
        if match is not None:
            if not isinstance(match, Mapping):
                raise TriggerError(f"trigger {name!r}: match must be a JSON object, not {type(match).__name__}")
            try:  # a wait's bounds: every emit of the key checks its payload against it
                check_match(match, (None, None))
            except ValidationError as exc:
                raise TriggerError(f"trigger {name!r}: {exc}") from None
            match = json.loads(json.dumps(match))
        if params is not None and not isinstance(params, Mapping):
            raise TriggerError(f"trigger {name!r}: params must be a mapping")
        if max_active_runs is not None and (
            isinstance(max_active_runs, bool) or not isinstance(max_active_runs, int) or max_active_runs < 1
        ):
            raise TriggerError(f"trigger {name!r}: max_active_runs must be an integer of at least 1")
        try:
            batched = parse_batch(batch) if batch is not None else None
            if batched is not None and not KEY_RE.fullmatch(f"trigger:{name}"):
                raise FlowControlError(
                    f"batch is keyed by 'trigger:{name}': a name of letters, digits, '_ . : / - @ ='"
                )
        except FlowControlError as exc:
            raise TriggerError(f"trigger {name!r}: {exc}") from None
        if paused is not None and not isinstance(paused, bool):
            raise TriggerError(f"trigger {name!r}: paused must be true or false, not {paused!r}")
        try:  # plain JSON, nested at most MAX_JSON_DEPTH (a deeper one would overflow the encoder)
            check_json(dict(params or {}), "params")
        except ValidationError as exc:
            raise TriggerError(f"trigger {name!r}: {exc}") from None
        params = json.loads(json.dumps(dict(params or {})))
        if sum(x is not None for x in (spec, dag, registered)) != 1:
            raise TriggerError(
                f"trigger {name!r}: give what to run: a spec, a DAG factory module:function or a registered DAG"
                " NAME[@N] (one of them)"
            )
        now = self.rows.now()
        target = resolve(
            self.orc, spec=spec, dag=dag, registered=registered, factory_modules=self._factory_modules,
            build_spec=lambda snap: _build_spec(snap, now, params),
            build_registered=lambda built: _build_spec(built, now, params), error=TriggerError,
        )  # fmt: skip
        tenant, snap, ref = target.tenant, target.spec, target.registered
        return tenant, {
            "tenant": tenant,
            "event_key": event,
            "match": match,
            "spec": snap,
            "spec_hash": spec_hash(snap) if snap is not None else None,
            "factory": dag if dag is not None else None,
            "registered": ref[0] if ref else None,
            "registered_version": ref[1] if ref else None,
            "params": params,
            "max_active_runs": max_active_runs,
            "batch": list(batched) if batched else None,
        }

    def apply(self, path: str | Path) -> list[Trigger]:
        """Upsert every trigger of a YAML/JSON file ``{"triggers": [{name, event, match, spec (a
        path relative to the file) | dag | registered, params, max_active_runs, batch, paused}]}``.
        Every entry is checked before any is written. An entry without ``paused`` keeps the
        trigger's flag."""
        p = Path(path)
        try:
            text = read_spec_text(p)  # bounded, UTF-8
        except SpecError as exc:
            raise TriggerError(str(exc)) from None
        doc = parse_spec(text, fmt="json" if p.suffix == ".json" else "yaml")
        entries = doc.get("triggers") if isinstance(doc, Mapping) else None
        if not isinstance(entries, list):
            raise TriggerError(f"{p}: expected a mapping with a 'triggers' list")
        prepared = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                raise TriggerError(f"{p}: triggers[{i}] must be a mapping with a 'name'")
            unknown = set(entry) - _ALLOWED
            if unknown:
                raise TriggerError(f"{p}: trigger {entry['name']!r}: unknown field(s) {sorted(map(str, unknown))}")
            kwargs = {k: v for k, v in entry.items() if k != "name"}
            if isinstance(kwargs.get("spec"), str):
                kwargs["spec"] = self._snapshot(p.parent / kwargs["spec"])
            prepared.append((entry["name"], kwargs))
        for name, kwargs in prepared:  # every entry valid first: nothing is written otherwise
            self._prepare(
                name, kwargs.get("event"), kwargs.get("match"), kwargs.get("spec"), kwargs.get("dag"),
                kwargs.get("registered"), kwargs.get("params"), kwargs.get("max_active_runs"), kwargs.get("paused"),
                batch=kwargs.get("batch"),
            )  # fmt: skip
        return [self.add(name, **kwargs) for name, kwargs in prepared]

    def _snapshot(self, spec: str | Path | Mapping[str, Any] | DAG) -> dict[str, Any]:
        return snapshot(spec, TriggerError)

    def _row(self, name: str) -> Any:
        found = self.rows.find(name) if isinstance(name, str) else []
        if not found:
            raise TriggerNotFound(f"no trigger named {name!r}")
        if len(found) > 1:
            tenants = ", ".join(repr(r.tenant) for r in found)
            raise TriggerError(
                f"trigger name {name!r} is used by the tenants {tenants}: act as one of them (ORCHESTRATOR_TENANT)"
            )
        return found[0]

    def _view_of(self, rows: TriggerRows, name: str) -> Trigger:
        row = rows.get(name)
        if row is None:
            raise TriggerNotFound(f"no trigger named {name!r}")
        return _view(row, rows.last_runs([(row.tenant, name)]).get((row.tenant, name)))

    def get(self, name: str) -> Trigger:
        row = self._row(name)
        return _view(row, self.rows.last_runs([(row.tenant, name)]).get((row.tenant, name)))

    def all(self) -> list[Trigger]:
        found = self.rows.all()
        last = self.rows.last_runs([(r.tenant, r.name) for r in found])
        return [_view(r, last.get((r.tenant, r.name))) for r in found]

    def pause(self, name: str) -> Trigger:
        """Stop starting runs: events emitted while paused record no firing (they are not
        replayed on resume); firings already waiting still fire."""
        rows = self._of(self._row(name).tenant)
        rows.update(name, paused=True)
        return self._view_of(rows, name)

    def resume(self, name: str) -> Trigger:
        rows = self._of(self._row(name).tenant)
        rows.update(name, paused=False)
        return self._view_of(rows, name)

    def remove(self, name: str) -> None:
        """Delete the trigger and its firings (its runs stay)."""
        self._of(self._row(name).tenant).remove(name)

    def firings(self, name: str, limit: int = 100) -> list[Any]:
        """The trigger's newest firings (rows: ``event``, ``event_id``, ``state``, ``run_id``,
        ``reason``, ``dag_version``, ``at``); raises :class:`TriggerNotFound`."""
        return self._of(self._row(name).tenant).firings(name, limit)

    # ------------------------------------------------------------------ firing

    def finish(self, event: int) -> list[Firing]:
        """Finish the firings the event row ``event`` wrote (the emitter calls it right after
        its commit), each trigger's older open firings first (waiting firings fire in event
        order). A firing another finisher holds is waited for, then found finished.
        The event is committed already: this never raises (what it could not finish, a beat's
        pass does)."""
        done: list[Firing] = []
        try:
            for tenant, name in self.rows.of_event(event):
                for each in self.rows.open_of(tenant, name, event):
                    fired = self.finish_one(tenant, name, each)
                    if each == event:
                        done.append(fired)
                    elif fired.state == "waiting":
                        done.append(self.finish_one(tenant, name, event))
                        break
        except Exception:
            log.warning("event %s: its triggers' firings are left to the next pass", event, exc_info=True)
        return done

    def finish_one(self, tenant: str, name: str, event: int) -> Firing:
        """Finish the firing of (trigger, event) if it is still open: start its run, or leave it
        waiting for room under max_active_runs. A transient database error leaves it open (a
        later pass finishes it); any other error fails it (``last_error``, the alert hook)."""
        rows = self._of(tenant)

        def decide(row: Any, found: Any, running: int, older: bool) -> tuple[str, str | None, str | None, Any]:
            limit = row.max_active_runs
            if older or (limit is not None and running >= limit):
                why = f"{running} run(s) running, max_active_runs {limit}" if limit is not None else "an older firing"
                return "waiting", None, f"waiting: {why}", None
            trig = _view(row, None)
            at = found.emitted_at if found.emitted_at.tzinfo else found.emitted_at.replace(tzinfo=dt.UTC)
            payload = dict(found.payload or {})
            key = f"trigger:{name}" if trig.batch is not None else None
            if trig.batch is not None:  # gathered: the run's events param lists the payloads
                payload = {BATCH_PARAM: [payload]}
            try:
                built, version = self.build(trig, at, payload)
                dag = self.orc.check(built, tenant=tenant)
                if self.orc.dags.is_paused(dag.name, tenant):
                    reason = f"dag_paused: DAG {dag.name!r} is paused (orchestrator dag unpause {dag.name})"
                    return "skipped", None, reason, version
                run = self.orc.submit(
                    dag,
                    tenant=tenant,
                    idempotency_key=idempotency_key(name, found.event_id),
                    logical_date=iso(at),
                    dag_version=version,
                    trigger=name,
                    concurrency_key=key,
                    batch=trig.batch,
                )
            except Exception as exc:
                if self.orc.is_transient(exc):
                    raise
                return "failed", None, f"{type(exc).__name__}: {exc}", None
            return "fired", run.id, None, version

        try:
            outcome = rows.finish(tenant, name, event, decide)
        except Exception as exc:
            if not self.orc.is_transient(exc):
                raise
            log.warning("trigger %s: event %s postponed: %s", name, event, exc)
            return Firing(name, event, None, reason=str(exc))
        if outcome is None:
            return Firing(name, event, None)
        state, run_id, reason, _version = outcome
        if state == "failed":
            log.error("trigger %s could not start a run for event %s: %s", name, event, reason)
            alert = {"event": "trigger_failed", "trigger": name, "tenant": tenant, "event_row": event, "error": reason}
            raise_alert(alert, webhook=self.orc.settings.alert_webhook or None, actor="triggers")
        return Firing(name, event, state, run_id, reason)

    def tick(self, limit: int = 1000) -> list[Firing]:
        """One pass (``orchestrator beat`` runs it with the schedules' pass): finish every open
        firing, oldest first: those whose emitter died before finishing them, and those waiting
        for room under max_active_runs. Never raises for one trigger's error; a database outage
        ends the pass."""
        done: list[Firing] = []
        blocked: set[tuple[str, str]] = set()  # at max_active_runs: its newer firings wait too
        try:
            for tenant, name, event in self.rows.open(limit):
                if (tenant, name) in blocked:
                    continue
                fired = self.finish_one(tenant, name, event)
                done.append(fired)
                if fired.state in ("waiting", None):
                    blocked.add((tenant, name))
        except Exception as exc:
            if not self.orc.is_transient(exc):
                log.exception("trigger pass failed")
            else:
                log.warning("trigger pass failed (the database is unreachable): %s", exc)
        return done

    def build(self, trig: Trigger, at: dt.datetime, payload: Mapping[str, Any]) -> tuple[DAG, int | None]:
        """The DAG the trigger runs for an event at ``at`` with ``payload``, and the registered
        version it was built from (None: not a registered DAG)."""
        params = {**trig.params, **payload}
        if trig.registered:
            found = self.orc.dags.version(trig.registered, trig.registered_version, tenant=trig.tenant)
            return _build_spec({**(found.spec or {}), "tenant": trig.tenant}, at, params), found.version
        if trig.factory:
            made = load_factory(trig.factory, self._factory_modules)(at, params)
            if not isinstance(made, DAG):
                raise TriggerError(f"factory {trig.factory!r} returned {type(made).__name__}, not a DAG")
            if made.tenant not in (DEFAULT_TENANT, trig.tenant):
                raise TriggerError(
                    f"factory {trig.factory!r} built a DAG of tenant {made.tenant!r}; trigger {trig.name!r} runs"
                    f" as tenant {trig.tenant!r}"
                )
            return made, None
        assert trig.spec is not None
        return _build_spec(trig.spec, at, params), None


def _build_spec(spec: Mapping[str, Any], at: dt.datetime, params: Mapping[str, Any]) -> DAG:
    rendered = render(dict(spec), at, dt.UTC)
    if params:
        rendered["params"] = {**rendered.get("params", {}), **params}
    return dag_from_spec(rendered)


def _aware(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)  # type: ignore[no-any-return]


def _view(row: Any, last: tuple[str, str] | None) -> Trigger:
    return Trigger(
        name=row.name,
        tenant=row.tenant,
        event=row.event_key,
        match=row.match,
        spec=row.spec,
        spec_hash=row.spec_hash,
        factory=row.factory,
        registered=row.registered,
        registered_version=row.registered_version,
        params=dict(row.params or {}),
        max_active_runs=row.max_active_runs,
        paused=bool(row.paused),
        batch=(int(row.batch[0]), float(row.batch[1])) if getattr(row, "batch", None) else None,
        last_error=row.last_error,
        last_error_at=_aware(row.last_error_at),
        last_run_id=last[0] if last else None,
        last_run_state=last[1] if last else None,
    )
