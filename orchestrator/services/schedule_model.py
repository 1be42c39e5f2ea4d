"""A schedule as a value (:class:`Schedule`: what it runs and when, as stored), a firing's outcome
(:class:`Fired`), the checks of a schedule's timing (the shortest interval allowed), and the port
the scheduler needs of the orchestrator (:class:`SchedulerPort`)."""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.cron import Timing
from ..core.dag import (
    DAG,
)
from ..core.errors import OrchestratorError
from ..core.firing import Policy
from ..store.schedules import iso

if TYPE_CHECKING:
    from ..core.config import Settings
    from .dag_registry import DagRegistry


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
