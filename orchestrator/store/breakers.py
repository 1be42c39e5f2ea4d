"""Circuit breakers per resource: the operator's settings (``orc_breakers``), the operator's
actions on them, their ledger (``orc_breaker_events``) and the reconciler's pass.

A task declares the resources it uses (``resources=["stripe", "erp:{tenant}"]``); a resource's
breaker counts the task's outcomes in the transaction of each outcome (server function
``orc_breaker_v1``: a success is a call, a time-out, a connection error or an exception class
named in ``failure_on`` a failure) over a sliding window, and trips when the window holds at
least ``min_calls`` calls, ``min_failures`` failures and a ``failure_rate`` share of failures.
Open, admission holds the resource's READY tasks (``orc_limit_held_v2`` says 'breaker'): no
retry is burned, nothing is published. After ``open_for`` it is half-open: ``probes`` permits,
each a lease of ``probe_lease`` seconds on the attempt admission gives it to; a probe's success
closes it, a failure (or a probe that outlives its lease) opens it again for twice as long, up
to ``open_max``. Closed again, admission ramps the resource up in waves of 1, 2, 4 ... tasks
(each wave once the previous one succeeded) up to ``ramp_max``.

Every change of a breaker's row is made under the admission lock; every state change and
operator action is a row of ``orc_breaker_events`` (actor, by), which the reconciler turns into
an alert (``alerts.breaker_changed``) once.

Breakers are deployment-wide: one breaker per resource counts and holds the tasks of every
tenant, and its ledger names the operators who changed it. A caller bound to a tenant
(:meth:`Breakers.scoped`, what a tenant-bound orchestrator and ``orchestrator --tenant T`` use)
is refused every read and action with one clear error, as the metrics of a bound caller leave
the breakers out; a hold on its own tasks is still named by ``explain``.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.dag import LIMIT_NAME_RE, TASK_NAME_RE, short
from ..core.errors import OrchestratorError, ValidationError
from . import schema as s
from .database import Database
from .dbtime import aware

t_breakers, t_counts, t_probes, t_events = s.breakers, s.breaker_counts, s.breaker_probes, s.breaker_events

#: the admission lock (``orc_limit_held_v2``): every change of a breaker's row is made under it
ADMISSION_LOCK = 1869767425
MODES = ("on", "metrics", "disabled")
STATES = ("closed", "open", "half_open")

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
#: the longest window, open period or probe lease
MAX_SECONDS = 7 * 86400.0


class UnknownBreakerError(OrchestratorError, LookupError):
    """No breaker has this name."""


def parse_duration(text: str | float, what: str) -> float:
    """``"60s"``, ``"10m"``, ``"1.5h"``, ``"500ms"`` or a number of seconds -> seconds."""
    if isinstance(text, bool):
        raise ValidationError(f"{what} must be a duration like 30s, 10m or 1h, not {short(text)}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        m = _DURATION_RE.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise ValidationError(f"{what} must be a duration like 30s, 10m or 1h, not {short(text)}")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not 0 < seconds <= MAX_SECONDS or math.isnan(seconds):
        raise ValidationError(f"{what} must be above 0 and at most 7 days, not {short(text)}")
    return seconds


def parse_open_for(text: str | float) -> tuple[float, float]:
    """``"30s"`` (always 30 s) or ``"30s..10m"`` (30 s at the first trip, doubled per consecutive
    re-open, at most 10 m) -> (min, max) seconds."""
    if isinstance(text, str) and ".." in text:
        low, _, high = text.partition("..")
        lo, hi = parse_duration(low, "open_for"), parse_duration(high, "open_for")
        if hi < lo:
            raise ValidationError(f"open_for {text!r}: the most must be at least the least")
        return lo, hi
    seconds = parse_duration(text, "open_for")
    return seconds, seconds


@dataclass(frozen=True)
class BreakerEvent:
    id: int
    name: str
    from_state: str | None
    to_state: str
    actor: str
    by: str | None
    reason: str | None
    at: dt.datetime

    def alert(self) -> dict[str, Any]:
        """The alert of a state change (``alerts.breaker_changed``)."""
        return {"event": "breaker_changed", "breaker": self.name, "from_state": self.from_state,
                "state": self.to_state, "actor": self.actor, "by": self.by, "reason": self.reason,
                "at": self.at.isoformat()}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "from_state": self.from_state, "to_state": self.to_state,
            "actor": self.actor, "by": self.by, "reason": self.reason, "at": self.at.isoformat(),
        }  # fmt: skip


@dataclass(frozen=True)
class Breaker:
    """A breaker's settings, its state and its window's counts now."""

    name: str
    mode: str
    state: str
    forced: bool
    window_seconds: float
    min_calls: int
    min_failures: int
    failure_rate: float
    failure_on: tuple[str, ...]
    open_min: float
    open_max: float
    probes: int
    probe_lease: float
    ramp_max: int
    open_for: float | None
    open_until: dt.datetime | None
    reopens: int
    probes_left: int
    wave: int | None
    wave_admitted: int
    calls: int = 0
    failures: int = 0
    #: probe leases held now: (run id, key, attempt, lease until)
    probes_out: list[tuple[str, str, int, dt.datetime]] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        """Whether admission holds the resource's READY tasks now (or would, once asked: an open
        breaker past open_until is half-open at the next admission)."""
        if self.mode != "on":
            return False
        if self.state == "open":
            return True
        if self.state == "half_open":
            return self.probes_left <= 0
        return self.wave is not None and self.wave_admitted >= self.wave

    def hold_text(self) -> str:
        """``breaker stripe open until 2026-11-27T03:00:00+00:00`` and the like (``explain``)."""
        if self.state == "open":
            until = "an operator closes it" if self.forced or self.open_until is None else self.open_until.isoformat()
            return f"breaker {self.name} open until {until}"
        if self.state == "half_open":
            return f"breaker {self.name} half-open: its {self.probes} probe(s) are out"
        return f"breaker {self.name} ramping up: wave of {self.wave} task(s) in flight"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "mode": self.mode, "state": self.state, "forced": self.forced,
            "window_seconds": self.window_seconds, "min_calls": self.min_calls, "min_failures": self.min_failures,
            "failure_rate": self.failure_rate, "failure_on": list(self.failure_on), "open_min": self.open_min,
            "open_max": self.open_max, "probes": self.probes, "probe_lease": self.probe_lease,
            "ramp_max": self.ramp_max, "open_for": self.open_for,
            "open_until": self.open_until.isoformat() if self.open_until else None, "reopens": self.reopens,
            "probes_left": self.probes_left, "wave": self.wave, "wave_admitted": self.wave_admitted,
            "calls": self.calls, "failures": self.failures, "holds": self.holds,
            "probes_out": [
                {"run_id": r, "key": k, "attempt": a, "lease_until": u.isoformat()} for r, k, a, u in self.probes_out
            ],
        }  # fmt: skip


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not LIMIT_NAME_RE.fullmatch(name):
        raise ValidationError(f"breaker {short(name)} must be 1-64 letters, digits, '_', '.', ':' or '-'")
    return name


def _count(value: Any, what: str, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValidationError(f"{what} must be an integer from {least} to {most}, not {short(value)}")
    return value


class Breakers:
    """The breakers' settings, operator actions, state and ledger."""

    def __init__(self, db: Database, tenant: str | None = None) -> None:
        self.db = db
        #: the tenant the caller is bound to (None: the deployment's operator); a bound caller
        #: is refused every read and action (:meth:`_deployment_wide`)
        self.tenant = tenant

    def scoped(self, tenant: str | None) -> Breakers:
        """These breakers as a caller bound to ``tenant`` may use them (``None``: every call)."""
        return self if tenant == self.tenant else Breakers(self.db, tenant)

    def _deployment_wide(self) -> None:
        """Raise :class:`ValidationError` for a caller bound to a tenant (nothing is read or written)."""
        if self.tenant is not None:
            raise ValidationError(
                f"breakers are deployment-wide: this orchestrator acts as tenant {self.tenant!r} and cannot read or"
                " change them (`orchestrator explain RUN` names a breaker that holds one of its tasks)"
            )

    def set(
        self,
        name: str,
        *,
        window: str | float = 60.0,
        min_calls: int = 20,
        failure_rate: float = 0.5,
        min_failures: int = 5,
        open_for: str | float = "30s..10m",
        probes: int = 1,
        probe_lease: str | float | None = None,
        ramp_max: int = 64,
        failure_on: Sequence[str] = (),
        mode: str = "on",
        by: str | None = None,
    ) -> Breaker:
        """Create the breaker ``name`` or change its settings (its state and counts stay; ``mode``
        on: counts and holds, metrics: counts and never holds, disabled: neither)."""
        self._deployment_wide()
        check_name(name)
        window_s = parse_duration(window, "window")
        open_min, open_max = parse_open_for(open_for)
        lease = parse_duration(probe_lease, "probe_lease") if probe_lease is not None else max(60.0, window_s)
        _count(min_calls, "min_calls", 1, 1_000_000)
        _count(min_failures, "min_failures", 1, 1_000_000)
        _count(probes, "probes", 1, 1000)
        _count(ramp_max, "ramp_max", 1, 1_000_000)
        if isinstance(failure_rate, bool) or not isinstance(failure_rate, (int, float)) or not 0 < failure_rate <= 1:
            raise ValidationError(f"failure_rate must be above 0 and at most 1, not {short(failure_rate)}")
        if mode not in MODES:
            raise ValidationError(f"mode must be one of {', '.join(MODES)}, not {short(mode)}")
        if isinstance(failure_on, str):
            failure_on = [failure_on]
        for item in failure_on:
            if not isinstance(item, str) or not TASK_NAME_RE.fullmatch(item):
                raise ValidationError(f"failure_on must list exception class names, not {short(item)}")
        values = {
            "mode": mode, "window_seconds": window_s, "min_calls": min_calls, "min_failures": min_failures,
            "failure_rate": float(failure_rate), "failure_on": list(failure_on) or None, "open_min": open_min,
            "open_max": open_max, "probes": probes, "probe_lease": lease, "ramp_max": ramp_max,
        }  # fmt: skip

        def tx(conn: Connection) -> None:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADMISSION_LOCK)))
            now = conn.execute(sa.select(sa.func.now())).scalar_one()
            had = conn.execute(sa.select(t_breakers.c.state).where(t_breakers.c.name == name)).first()
            if had is None:
                conn.execute(
                    t_breakers.insert().values(name=name, state="closed", changed_at=now, updated_at=now, **values)
                )
            else:
                conn.execute(t_breakers.update().where(t_breakers.c.name == name).values(updated_at=now, **values))
            if mode != "on" and had is not None and had.state != "closed":
                conn.execute(
                    sa.text("SELECT orc_breaker_move_v1(:n, 'closed', 'operator', :by, :why)"),
                    {"n": name, "by": by, "why": f"mode {mode}"},
                )
            reason = (
                f"set: mode {mode}, window {window_s:g}s, min_calls {min_calls}, min_failures {min_failures},"
                f" failure_rate {failure_rate:g}, open_for {open_min:g}..{open_max:g}s, probes {probes}"
            )
            state = "closed" if had is None or mode != "on" else had.state
            self._event(conn, name, had.state if had else None, state, by, reason)

        self.db.transaction(tx)
        return self.get(name)

    def open(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Force the breaker open until :meth:`close` (admission holds the resource's tasks)."""
        return self._move(name, "open", by, reason or "forced open by an operator", forced=True)

    def close(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Close the breaker now (no ramp: the operator vouches for the resource); its window's
        counts are forgotten and a disabled or metrics-only breaker is back on."""
        return self._move(name, "closed", by, reason or "closed by an operator", mode="on")

    def disable(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """The breaker never trips and counts nothing until set or closed again."""
        return self._move(name, "closed", by, reason or "disabled by an operator", mode="disabled")

    def remove(self, name: str, *, by: str | None = None) -> bool:
        self._deployment_wide()
        check_name(name)

        def tx(conn: Connection) -> bool:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADMISSION_LOCK)))
            gone = conn.execute(t_breakers.delete().where(t_breakers.c.name == name)).rowcount
            conn.execute(t_counts.delete().where(t_counts.c.name == name))
            conn.execute(t_probes.delete().where(t_probes.c.name == name))
            if gone:
                self._event(conn, name, None, "removed", by, "removed by an operator")
            return bool(gone)

        return self.db.transaction(tx)

    def _move(
        self, name: str, to: str, by: str | None, reason: str, *, forced: bool = False, mode: str | None = None
    ) -> Breaker:
        self._deployment_wide()
        check_name(name)

        def tx(conn: Connection) -> None:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADMISSION_LOCK)))
            row = conn.execute(sa.select(t_breakers).where(t_breakers.c.name == name)).first()
            if row is None:
                raise UnknownBreakerError(f"no breaker named {name!r} (orchestrator breaker set {name})")
            values: dict[str, Any] = {"forced": forced, "wave": None, "wave_admitted": 0, "wave_done": 0}
            if mode is not None:
                values["mode"] = mode
            if to == "closed":
                values.update(reopens=0, open_for=None)
                conn.execute(t_counts.delete().where(t_counts.c.name == name))
            else:
                values["open_for"] = row.open_for or row.open_min
            conn.execute(t_breakers.update().where(t_breakers.c.name == name).values(**values))
            conn.execute(
                sa.text("SELECT orc_breaker_move_v1(:n, :to, 'operator', :by, :why)"),
                {"n": name, "to": to, "by": by, "why": reason},
            )

        self.db.transaction(tx)
        return self.get(name)

    @staticmethod
    def _event(conn: Connection, name: str, was: str | None, to: str, by: str | None, reason: str) -> None:
        conn.execute(
            t_events.insert().values(
                name=name, from_state=was, to_state=to, actor="operator", by=by, reason=reason, at=sa.func.now()
            )
        )

    # reads
    def get(self, name: str) -> Breaker:
        self._deployment_wide()
        check_name(name)
        found = self.find([name])
        if not found:
            raise UnknownBreakerError(f"no breaker named {name!r} (orchestrator breaker set {name})")
        return found[0]

    def find(self, names: Sequence[str] | None = None) -> list[Breaker]:
        """The breakers (``names``: those of them), by name, with their window's counts now."""
        self._deployment_wide()

        def read(conn: Connection) -> list[Breaker]:
            query = sa.select(t_breakers).order_by(t_breakers.c.name)
            if names is not None:
                query = query.where(t_breakers.c.name.in_(list(names)))
            rows = conn.execute(query).all()
            if not rows:
                return []
            sums = {
                r.name: (int(r.calls), int(r.failures))
                for r in conn.execute(
                    sa.text(
                        "SELECT k.name, coalesce(sum(c.calls), 0) AS calls, coalesce(sum(c.failures), 0) AS failures"
                        " FROM orc_breakers k JOIN orc_breaker_counts c ON c.name = k.name"
                        " AND c.second > now() - make_interval(secs => k.window_seconds)"
                        " WHERE k.name = ANY (CAST(:names AS text[])) GROUP BY k.name"
                    ),
                    {"names": [r.name for r in rows]},
                )
            }
            out: dict[str, list[tuple[str, str, int, dt.datetime]]] = {}
            for p in conn.execute(
                sa.select(t_probes).where(t_probes.c.name.in_([r.name for r in rows])).order_by(t_probes.c.lease_until)
            ):
                out.setdefault(p.name, []).append((p.run_id, p.key, int(p.attempt), _at(p.lease_until)))
            return [breaker_row(r, sums.get(r.name, (0, 0)), out.get(r.name, [])) for r in rows]

        return self.db.read(read)

    def events(self, name: str | None = None, *, limit: int = 100) -> list[BreakerEvent]:
        """The breakers' ledger, newest last (``name``: one breaker's)."""
        self._deployment_wide()
        query = sa.select(t_events).order_by(t_events.c.id.desc()).limit(limit)
        if name is not None:
            query = query.where(t_events.c.name == check_name(name))
        rows = self.db.read(lambda conn: conn.execute(query).all())
        return [_event(r) for r in reversed(rows)]

    def holding(self, resources: Sequence[str]) -> Breaker | None:
        """The first of ``resources``' breakers that holds their tasks now (for ``explain``)."""
        for b in self.find(sorted(set(resources))):
            if b.holds:
                return b
        return None

    # the reconciler's pass
    def reconcile(self) -> list[BreakerEvent]:
        """:meth:`tick` in its own transaction."""
        return self.db.transaction(self.tick)

    def tick(self, conn: Connection) -> list[BreakerEvent]:
        """Expired probe leases as failures, open breakers whose time is up half-open, stale ramp
        waves handed out again, old buckets deleted (``orc_breaker_tick_v1``); then the state
        changes not yet alerted, marked alerted (the caller raises their alerts after commit)."""
        conn.execute(sa.text("SELECT orc_breaker_tick_v1()"))
        rows = conn.execute(
            sa.update(t_events)
            .where(t_events.c.alerted_at.is_(None))
            .values(alerted_at=sa.func.now())
            .returning(*t_events.c)
        ).all()
        return sorted((_event(r) for r in rows), key=lambda e: e.id)


def breaker_row(r: Any, sums: tuple[int, int], probes_out: list[tuple[str, str, int, dt.datetime]]) -> Breaker:
    return Breaker(
        name=r.name, mode=r.mode, state=r.state, forced=bool(r.forced), window_seconds=float(r.window_seconds),
        min_calls=int(r.min_calls), min_failures=int(r.min_failures), failure_rate=float(r.failure_rate),
        failure_on=tuple(r.failure_on or ()), open_min=float(r.open_min), open_max=float(r.open_max),
        probes=int(r.probes), probe_lease=float(r.probe_lease), ramp_max=int(r.ramp_max),
        open_for=None if r.open_for is None else float(r.open_for),
        open_until=None if r.open_until is None else aware(r.open_until), reopens=int(r.reopens),
        probes_left=int(r.probes_left), wave=r.wave, wave_admitted=int(r.wave_admitted),
        calls=sums[0], failures=sums[1], probes_out=probes_out,
    )  # fmt: skip


def _event(r: Any) -> BreakerEvent:
    return BreakerEvent(int(r.id), r.name, r.from_state, r.to_state, r.actor, r.by, r.reason, _at(r.at))


def _at(value: dt.datetime) -> dt.datetime:
    found = aware(value)
    assert found is not None
    return found
