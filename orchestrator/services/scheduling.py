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
import hashlib
import importlib
import inspect
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..core.cron import HORIZON, ScheduleError, Timing, count_instants, instants, last_instants, next_instant
from ..core.dag import (
    DAG,
    MAX_NAME_CHARS,
    TENANT_RE,
    dag_from_spec,
    load_spec,
    parse_spec,
    read_spec_text,
    short,
    text_problem,
)
from ..core.errors import ConflictError, OrchestratorError, RunNotFound, SpecError, ValidationError
from ..core.firing import COUNT_MOST, Decision, Policy, looked_at, plan, summary_reason
from ..store.schedules import ScheduleRows, iso
from .alerts import raise_alert

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ..core.config import Settings
    from .dag_registry import DagRegistry

log = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
PLACEHOLDERS = ("logical_date", "ds")
#: firings made by a person (``schedule trigger``, ``backfill``): they run a paused DAG, as a
#: submit by hand does
BY_HAND = ("manual", "backfill")
#: firings left pending this long are finished by any beat (the one that wrote them died)
PENDING_AFTER = 15.0
#: the reason of a pending firing whose decision was to cancel the running runs first (overlap
#: cancel_previous): whoever finishes the firing, the beat that decided it or another one, does
CANCEL_PREVIOUS = "overlap cancel_previous: cancel the schedule's running runs first"


@dataclass(frozen=True)
class Schedule:
    """A schedule as stored, with what the last firing left (read-only view)."""

    name: str
    tenant: str
    timing: Timing
    policy: Policy
    spec: dict[str, Any] | None
    spec_hash: str | None
    factory: str | None
    params: dict[str, Any]
    paused: bool
    next_at: dt.datetime
    #: a DAG of the registry (``orchestrator dag register``) and its version (None: the latest
    #: when it fires)
    registered: str | None = None
    registered_version: int | None = None
    last_at: dt.datetime | None = None
    buffered_at: dt.datetime | None = None
    last_run_id: str | None = None
    last_run_state: str | None = None
    last_error: str | None = None
    last_error_at: dt.datetime | None = None

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
        zone = self.timing.zone
        return {
            "name": self.name,
            "tenant": self.tenant,
            "cron": self.timing.cron,
            "every": self.timing.every,
            "tz": self.timing.tz,
            "dst_gap": self.timing.dst_gap,
            "dst_fold": self.timing.dst_fold,
            "catchup": self.policy.catchup,
            "max_catchup": self.policy.max_catchup,
            "overlap": self.policy.overlap,
            "max_active_runs": self.policy.max_active_runs,
            "runs": self.what,
            "spec_hash": self.spec_hash,
            "factory": self.factory,
            "registered": self.registered,
            "registered_version": self.registered_version,
            "params": self.params,
            "paused": self.paused,
            "next_fire": iso(self.next_at) if not self.paused else None,
            "next_fire_local": self.next_at.astimezone(zone).isoformat() if not self.paused else None,
            "last_fire": iso(self.last_at) if self.last_at else None,
            "buffered": iso(self.buffered_at) if self.buffered_at else None,
            "last_run": self.last_run_id,
            "last_run_state": self.last_run_state,
            "last_error": self.last_error,
            "last_error_at": iso(self.last_error_at) if self.last_error_at else None,
        }


@dataclass(frozen=True)
class Fired:
    """One instant a pass, a trigger or a backfill dealt with."""

    schedule: str
    logical_date: dt.datetime
    run_id: str | None
    created: bool
    error: str | None = None
    #: why the instant ran nothing although it was due (its DAG is paused)
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_placeholders(value: Any, where: str = "spec") -> None:
    """Refuse any ``{{ … }}`` but ``{{ logical_date }}`` and ``{{ ds }}``."""
    if isinstance(value, str):
        for m in _PLACEHOLDER.finditer(value):
            if m.group(1) not in PLACEHOLDERS:
                raise ScheduleError(
                    f"{where}: unknown placeholder {m.group(0)!r}; only {{{{ logical_date }}}} and {{{{ ds }}}} exist"
                )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_placeholders(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_placeholders(v, f"{where}[{i}]")


def render(value: Any, logical_date: dt.datetime, zone: Any) -> Any:
    """``value`` with ``{{ logical_date }}`` and ``{{ ds }}`` replaced in every string."""
    fills = {"logical_date": iso(logical_date), "ds": logical_date.astimezone(zone).date().isoformat()}
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: fills.get(m.group(1), m.group(0)), value)
    if isinstance(value, Mapping):
        return {k: render(v, logical_date, zone) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, logical_date, zone) for v in value]
    return value


#: the attribute :func:`dag_factory` sets on a function it declares a DAG factory
FACTORY_MARK = "__orchestrator_dag_factory__"
_FACTORY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
#: the modules factories may live in when no setting says (``ORCHESTRATOR_DAG_FACTORY_MODULES``)
DEFAULT_FACTORY_MODULES = ("tasks.dags",)

F = TypeVar("F", bound=Callable[..., Any])


def dag_factory(fn: F) -> F:
    """Declare ``fn(logical_date, params) -> DAG`` a DAG factory a schedule may run::

        from orchestrator import dag_factory

        @dag_factory
        def daily_etl(logical_date, params) -> DAG: ...

    A schedule's ``dag`` (``module:function``) must name a function so declared, in a module of
    ``ORCHESTRATOR_DAG_FACTORY_MODULES`` (default ``tasks.dags``; a listed package covers its
    submodules). Anything else (``builtins:eval``, ``shutil:rmtree``, an undeclared function)
    is refused with :class:`FactoryNotAllowed` when the schedule is added and again when it fires."""
    if not callable(fn):
        raise TypeError(f"@dag_factory decorates a function, not {type(fn).__name__}")
    setattr(fn, FACTORY_MARK, True)
    return fn


class FactoryNotAllowed(ScheduleError):
    """A schedule names a ``module:function`` that is not a declared DAG factory (not decorated
    with :func:`dag_factory`, or in a module ``ORCHESTRATOR_DAG_FACTORY_MODULES`` does not list):
    it is never called."""


def _module_allowed(module_name: str, modules: Iterable[str]) -> bool:
    return any(module_name == m or module_name.startswith(m + ".") for m in modules)


def load_factory(
    path: str, modules: Iterable[str] = DEFAULT_FACTORY_MODULES
) -> Callable[[dt.datetime, dict[str, Any]], DAG]:
    """The DAG factory ``module:function``: a function decorated with :func:`dag_factory` in a
    module ``modules`` lists (``ORCHESTRATOR_DAG_FACTORY_MODULES``). A module outside the list is
    not even imported. Raises :class:`FactoryNotAllowed` (not declared, or not allowed) or
    :class:`ScheduleError` (malformed, unimportable, wrong signature) naming what is wrong."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ScheduleError(f"factory {short(path)} must be module:function")
    if not _FACTORY_PATH.fullmatch(path):
        raise ScheduleError(f"factory {short(path)} must be module:function (Python names)")
    module_name, attr = path.split(":")
    modules = tuple(modules)
    if not _module_allowed(module_name, modules):
        raise FactoryNotAllowed(
            f"factory {path!r}: module {module_name!r} is not a DAG factory module (ORCHESTRATOR_DAG_FACTORY_MODULES"
            f" lists {', '.join(modules) or 'none'}); declare factories with @dag_factory in one of them"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import error of any kind is the user module's
        raise ScheduleError(f"factory {path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ScheduleError(f"factory {path!r}: {module_name} has no function {attr!r}")
    if getattr(fn, FACTORY_MARK, False) is not True or not inspect.isfunction(fn):
        raise FactoryNotAllowed(
            f"factory {path!r} is not a declared DAG factory: decorate it with @orchestrator.dag_factory"
        )
    try:
        inspect.signature(fn).bind(dt.datetime.now(dt.UTC), {})
    except TypeError:
        raise ScheduleError(f"factory {path!r} must accept (logical_date, params)") from None
    return fn


def min_interval_problem(timing: Timing, least: float) -> str | None:
    """Why ``timing`` fires more often than every ``least`` seconds
    (``ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS``), or ``None``."""
    if least <= 0:
        return None
    setting = f"ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS is {least:g}"
    if timing.every is not None:
        if float(timing.every) < least:
            return f"every {timing.every:g}s is more often than the minimum interval ({setting})"
        return None
    gap = cron_min_gap(str(timing.cron))
    if gap < least:
        return (
            f"cron {timing.cron!r} fires as little as {gap:g}s apart, more often than the minimum interval ({setting})"
        )
    return None


def cron_min_gap(cron: str) -> float:
    """The shortest time (seconds) between two instants a (valid, 5-field) cron expression may
    fire, from its minute and hour fields (a lower bound: day boundaries counted as adjacent)."""
    from croniter import croniter

    expanded = croniter(cron).expanded
    minutes = list(range(60)) if expanded[0] == ["*"] else sorted(int(m) for m in expanded[0])
    hours = list(range(24)) if expanded[1] == ["*"] else sorted(int(h) for h in expanded[1])
    marks = sorted({h * 60 + m for h in hours for m in minutes})
    if len(marks) == 1:
        return 86400.0
    gaps = [b - a for a, b in itertools.pairwise(marks)] + [1440 - marks[-1] + marks[0]]
    return 60.0 * min(gaps)


class _Submitted(Protocol):
    @property
    def id(self) -> str: ...


class SchedulerPort(Protocol):
    """What :class:`Schedules` needs of its orchestrator (an
    :class:`~orchestrator.engine.facade.Orchestrator`, which builds it: a Protocol, so that this module
    does not import the engine back)."""

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
    ) -> _Submitted: ...

    @property
    def dags(self) -> DagRegistry: ...

    def cancel(self, run_id: str, *, by: str | None = None) -> int: ...

    def is_transient(self, exc: BaseException) -> bool: ...


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
        snapshot: dict[str, Any] | None = None
        factory: str | None = None
        ref: tuple[str, int | None] | None = None
        tenant = self.orc.tenant or "default"
        now = self.rows.now()
        first = next_instant(timing, now)
        if first is None:
            raise ScheduleError(f"{timing.describe()} does not fire within {HORIZON.days // 366} years")
        if spec is not None:
            snapshot = self._snapshot(spec)
            check_placeholders(snapshot)
            tenant = self.orc.tenant or str(snapshot.get("tenant") or "default")
            # the spec as it would fire at its first instant must be a valid DAG for this deployment
            self.orc.check(self._build_spec(snapshot, first, timing), tenant=tenant)
        elif registered is not None:
            ref = self._check_registered(registered, first, timing, params, tenant)
        else:
            assert dag is not None
            load_factory(dag, self._factory_modules)
            factory = dag
        if not TENANT_RE.fullmatch(tenant):
            raise ValidationError(f"tenant {tenant!r} must be 1-64 letters, digits, '_' or '-'")
        # names are per tenant: another tenant's schedule of that name is another schedule
        rows = self._of(tenant)
        existing = rows.get(name)
        values = {
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
            "paused": bool(existing.paused) if paused is None and existing is not None else bool(paused),
            "next_at": first,
        }
        changed = existing is None or _timing(existing) != timing
        rows.put(name, values, timing_changed=changed)
        return self._view_of(rows, name)

    def apply(self, path: str | Path) -> list[Schedule]:
        """Upsert every schedule of a YAML/JSON file ``{"schedules": [{name, cron|every, tz,
        spec (a path relative to the file) | dag | registered (NAME or NAME@N), params, dst_gap, dst_fold, catchup,
        max_catchup, overlap, max_active_runs, paused}]}``. Every entry is checked before any
        is written. An entry without ``paused`` keeps the schedule's flag (a paused schedule
        stays paused; a new one starts unpaused)."""
        p = Path(path)
        try:
            text = read_spec_text(p)  # bounded, UTF-8
        except SpecError as exc:
            raise ScheduleError(str(exc)) from None
        doc = parse_spec(text, fmt="json" if p.suffix == ".json" else "yaml")
        entries = doc.get("schedules") if isinstance(doc, Mapping) else None
        if not isinstance(entries, list):
            raise ScheduleError(f"{p}: expected a mapping with a 'schedules' list")
        allowed = {
            "name", "cron", "every", "tz", "spec", "dag", "registered", "params", "dst_gap", "dst_fold", "catchup",
            "max_catchup", "overlap", "max_active_runs", "paused",
        }  # fmt: skip
        prepared = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                raise ScheduleError(f"{p}: schedules[{i}] must be a mapping with a 'name'")
            unknown = set(entry) - allowed
            if unknown:
                raise ScheduleError(f"{p}: schedule {entry['name']!r}: unknown field(s) {sorted(map(str, unknown))}")
            kwargs = {k: v for k, v in entry.items() if k != "name"}
            if isinstance(kwargs.get("spec"), str):
                kwargs["spec"] = self._snapshot(p.parent / kwargs["spec"])
            prepared.append((entry["name"], kwargs))
        for name, kwargs in prepared:  # all of them valid first: a dry pass that writes nothing
            self._check_definition(name, **kwargs)
        return [self.add(name, **kwargs) for name, kwargs in prepared]

    def _check_definition(self, name: str, **kwargs: Any) -> None:
        timing = Timing(
            cron=kwargs.get("cron"), every=kwargs.get("every"), tz=kwargs.get("tz", "UTC"),
            dst_gap=kwargs.get("dst_gap", "shift"), dst_fold=kwargs.get("dst_fold", "first"),
        )  # fmt: skip
        self._check_interval(timing)
        Policy(
            catchup=kwargs.get("catchup", "latest"), max_catchup=kwargs.get("max_catchup", 10),
            overlap=kwargs.get("overlap", "allow"), max_active_runs=kwargs.get("max_active_runs"),
        )  # fmt: skip
        paused = kwargs.get("paused")
        if paused is not None and not isinstance(paused, bool):
            raise ScheduleError(f"schedule {name!r}: paused must be true or false, not {paused!r}")
        given = [k for k in ("spec", "dag", "registered") if kwargs.get(k) is not None]
        if len(given) > 1:
            raise ScheduleError(f"schedule {name!r}: give one of 'spec', 'dag' and 'registered', not {given}")
        if kwargs.get("dag") is not None:
            load_factory(kwargs["dag"], self._factory_modules)
        elif kwargs.get("registered") is not None:
            first = next_instant(timing, self.rows.now())
            params = kwargs.get("params") or {}
            if not isinstance(params, Mapping):
                raise ScheduleError(f"schedule {name!r}: params must be a mapping")
            if first is not None:
                self._check_registered(kwargs["registered"], first, timing, params, self.orc.tenant or "default")
        elif kwargs.get("spec") is not None:
            snapshot = self._snapshot(kwargs["spec"])
            check_placeholders(snapshot)
            first = next_instant(timing, self.rows.now())
            if first is not None:
                self.orc.check(self._build_spec(snapshot, first, timing), tenant=self.orc.tenant)
        else:
            raise ScheduleError(f"schedule {name!r}: give 'spec', 'dag' or 'registered'")

    def _check_registered(
        self, ref: Any, first: dt.datetime, timing: Timing, params: Mapping[str, Any], tenant: str
    ) -> tuple[str, int | None]:
        """``NAME`` or ``NAME@N`` of a registered DAG of ``tenant`` that builds and would submit
        at the schedule's first instant; raises :class:`DagNotFound`, :class:`ValidationError`."""
        from .dag_registry import parse_ref

        if not isinstance(ref, str):
            raise ScheduleError(f"registered must be NAME or NAME@N, not {type(ref).__name__}")
        name, version = parse_ref(ref)
        found = self.orc.dags.version(name, version, tenant=tenant)
        spec = {**(found.spec or {}), "tenant": tenant}
        check_placeholders(spec)
        self.orc.check(self._build_spec(spec, first, timing, params), tenant=tenant)
        return name, version

    def _snapshot(self, spec: str | Path | Mapping[str, Any] | DAG) -> dict[str, Any]:
        if isinstance(spec, DAG):
            return spec.to_spec()
        if isinstance(spec, Mapping):
            dag_from_spec(spec)  # the shape, before anything else
            return json.loads(json.dumps(spec))  # type: ignore[no-any-return]
        if not isinstance(spec, (str, os.PathLike)):
            raise ScheduleError(f"spec must be a spec file's path, a mapping or a DAG, not {type(spec).__name__}")
        p = Path(spec)
        if not p.is_file():
            raise ScheduleError(f"spec file {str(p)!r} does not exist")
        return load_spec(p).to_spec()

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
            if made.tenant not in ("default", sched.tenant):
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


class ScheduleNotFound(OrchestratorError):
    """No schedule has the given name (for this tenant)."""


def _aware(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)  # type: ignore[no-any-return]


def _when(value: Any) -> dt.datetime:
    found = _aware(value)
    assert found is not None
    return found


def _timing(row: Any) -> Timing:
    return Timing(cron=row.cron, every=row.every_seconds, tz=row.timezone, dst_gap=row.dst_gap, dst_fold=row.dst_fold)


def _policy(row: Any, grace: float = 60.0) -> Policy:
    return Policy(
        catchup=row.catchup, max_catchup=row.max_catchup, overlap=row.overlap,
        max_active_runs=row.max_active_runs, grace=grace,
    )  # fmt: skip


def _view(row: Any, last: tuple[str, str] | None) -> Schedule:
    next_at = _when(row.next_at)
    return Schedule(
        name=row.name,
        tenant=row.tenant,
        timing=_timing(row),
        policy=_policy(row),
        spec=row.spec,
        spec_hash=row.spec_hash,
        factory=row.factory,
        registered=row.registered,
        registered_version=row.registered_version,
        params=dict(row.params or {}),
        paused=bool(row.paused),
        next_at=next_at,
        last_at=_aware(row.last_at),
        buffered_at=_aware(row.buffered_at),
        last_run_id=last[0] if last else row.last_run_id,
        last_run_state=last[1] if last else None,
        last_error=row.last_error,
        last_error_at=_aware(row.last_error_at),
    )
