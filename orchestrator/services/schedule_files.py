"""A file of schedules (``orchestrator schedule apply FILE``, :meth:`Schedules.apply`): every entry
checked before any is written, then each upserted."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.cron import ScheduleError, Timing, next_instant
from ..core.dag import parse_spec, read_spec_text
from ..core.errors import SpecError
from ..core.firing import Policy
from ..core.routing import DEFAULT_TENANT
from .schedule_model import Schedule
from .targets import check_placeholders, load_factory

if TYPE_CHECKING:
    import datetime as dt

    from ..core.dag import DAG
    from ..store.schedules import ScheduleRows
    from .schedule_model import SchedulerPort


class Schedules(Protocol):
    """What a file of schedules uses of :class:`~orchestrator.services.scheduling.Schedules`."""

    orc: SchedulerPort
    rows: ScheduleRows

    @property
    def _factory_modules(self) -> tuple[str, ...]: ...

    def _check_interval(self, timing: Timing) -> None: ...

    def _check_registered(
        self, ref: Any, first: dt.datetime, timing: Timing, params: Mapping[str, Any], tenant: str
    ) -> tuple[str, int | None]: ...

    def _snapshot(self, spec: Any) -> dict[str, Any]: ...

    def _build_spec(
        self, spec: Mapping[str, Any], at: dt.datetime, timing: Timing, params: Mapping[str, Any] = ...
    ) -> DAG: ...

    @property
    def add(self) -> Callable[..., Schedule]: ...


def apply(schedules: Schedules, path: str | Path) -> list[Schedule]:
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
            kwargs["spec"] = schedules._snapshot(p.parent / kwargs["spec"])
        prepared.append((entry["name"], kwargs))
    for name, kwargs in prepared:  # all of them valid first: a dry pass that writes nothing
        check_definition(schedules, name, **kwargs)
    return [schedules.add(name, **kwargs) for name, kwargs in prepared]


def check_definition(schedules: Schedules, name: str, **kwargs: Any) -> None:
    """One entry of a schedules file checked as :meth:`Schedules.add` would, writing nothing."""
    timing = Timing(
        cron=kwargs.get("cron"), every=kwargs.get("every"), tz=kwargs.get("tz", "UTC"),
        dst_gap=kwargs.get("dst_gap", "shift"), dst_fold=kwargs.get("dst_fold", "first"),
    )  # fmt: skip
    schedules._check_interval(timing)
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
        load_factory(kwargs["dag"], schedules._factory_modules)
    elif kwargs.get("registered") is not None:
        first = next_instant(timing, schedules.rows.now())
        params = kwargs.get("params") or {}
        if not isinstance(params, Mapping):
            raise ScheduleError(f"schedule {name!r}: params must be a mapping")
        if first is not None:
            schedules._check_registered(
                kwargs["registered"], first, timing, params, schedules.orc.tenant or DEFAULT_TENANT
            )
    elif kwargs.get("spec") is not None:
        snapshot = schedules._snapshot(kwargs["spec"])
        check_placeholders(snapshot)
        first = next_instant(timing, schedules.rows.now())
        if first is not None:
            schedules.orc.check(schedules._build_spec(snapshot, first, timing), tenant=schedules.orc.tenant)
    else:
        raise ScheduleError(f"schedule {name!r}: give 'spec', 'dag' or 'registered'")
