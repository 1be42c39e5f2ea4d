"""Waits (pure code): what a wait node, a sensor and a deferred body wait for.

A waiting task is a row in state ``WAITING`` (``store/sql/wait.sql``): it holds no worker slot,
no broker message and no pool or limit slot, and its instant and deadline are absolute, fixed
when the wait begins. It is woken by the transition that satisfies it (an event or a signal
written by :meth:`Orchestrator.emit` / ``RunHandle.signal``, an approval) or by the
reconciler's indexed pass over the waits due (a sleep over, a sensor's next check, a deadline).

* :class:`WaitSpec`: a wait node (``dag.wait``: an event whose payload contains ``match``, its
  result the payload; an instant, ``until`` / ``at`` + ``tz`` / ``delay``, its result ``None``;
  ``dag.approval``: ``orchestrator approve | reject``). ``timeout`` ends it FAILED with
  ``WaitTimeout`` (or SKIPPED with ``on_timeout="skip"``).
* :class:`SensorSpec`: a sensor (``dag.sensor``): its check task runs every ``every`` seconds
  (times ``backoff`` after each "not yet", at most ``max_every``) until it returns something
  truthy (its result) or ``timeout``; between checks it waits as a row (Airflow's reschedule
  mode).
* :class:`Defer`: ``raise orchestrator.Defer(...)`` inside a task: the task waits, then is called
  again (one more attempt allowed: its retry budget untouched) with ``current_context().resumed``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ValidationError

#: the task name of a wait node (it never runs on a worker)
WAIT_TASK = "orchestrator.wait"
#: kinds of a wait node
KINDS = ("event", "sleep", "approval")
#: how far back (seconds) a wait that begins looks for its event, by default: an event emitted
#: this long before the wait began still wakes it
DEFAULT_LOOKBACK = 3600.0
#: the longest wait, lookback, timeout or sensor interval (seconds): about ten years
MAX_SECONDS = 10 * 366 * 86400.0
ON_TIMEOUT = ("fail", "skip")
#: an event key: 1-200 of letters, digits and ``. _ : / -``
EVENT_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}")
#: a wall time (``until="09:30"``): HH:MM or HH:MM:SS
WALL_TIME_RE = re.compile(r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?")
#: the most bytes of JSON a ``match`` (a wait's, a Defer's, an event trigger's) may hold, the
#: most elements of any array in it and how deep it may nest: an emit checks its payload against the match of every wait
#: and trigger on its key, and a wait that begins checks the match against every event of its
#: lookback; JSON containment of an array costs its elements times the payload array's, so a
#: 10,000-element match against a 59 KB payload took 0.62 s of server CPU per check
MAX_MATCH_BYTES = 4096
MAX_MATCH_ITEMS = 32
MAX_MATCH_DEPTH = 16


def _fail(message: str, where: tuple[str | None, str | None]) -> ValidationError:
    return ValidationError(message, dag=where[0], node=where[1])


def check_event_key(key: Any, where: tuple[str | None, str | None] = (None, None), what: str = "event") -> str:
    if not isinstance(key, str) or not EVENT_KEY_RE.fullmatch(key):
        raise _fail(
            f"{what} key must be 1-200 letters, digits, '.', '_', ':', '/' or '-' (starting with a letter or a"
            f" digit), not {str(key)[:60]!r}",
            where,
        )
    return key


def check_seconds(value: Any, what: str, where: tuple[str | None, str | None], *, zero: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(f"{what} must be a number of seconds, not {str(value)[:40]!r}", where)
    if value < 0 or (value == 0 and not zero) or value > MAX_SECONDS:
        low = "0" if zero else "above 0"
        raise _fail(f"{what} must be {low} and at most {MAX_SECONDS:.0f} seconds, not {value}", where)
    return float(value)


def check_match(match: Any, where: tuple[str | None, str | None]) -> dict[str, Any] | None:
    """A match is data: a JSON object the event's payload must contain (JSON containment), of at
    most :data:`MAX_MATCH_BYTES` of JSON and :data:`MAX_MATCH_ITEMS` elements in any array (its
    values are checked as plain JSON with the DAG: ``dag.check_json``). Raises
    :class:`ValidationError` naming the node."""
    if match is None:
        return None
    if not isinstance(match, Mapping) or not all(isinstance(k, str) for k in match):
        raise _fail(f"match must be a JSON object the payload contains, not {type(match).__name__}", where)
    stack: list[tuple[Any, int]] = [(match, 0)]
    seen = 0
    while stack:  # iterative, and each value is at least a byte of JSON: a cycle ends here too
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_MATCH_BYTES:
            raise _fail(f"match holds more than {MAX_MATCH_BYTES} values; at most {MAX_MATCH_BYTES} bytes", where)
        if isinstance(item, (Mapping, list, tuple)) and depth >= MAX_MATCH_DEPTH:
            raise _fail(f"match is nested more than {MAX_MATCH_DEPTH} deep", where)
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            if len(item) > MAX_MATCH_ITEMS:
                raise _fail(
                    f"match holds an array of {len(item)} elements; at most {MAX_MATCH_ITEMS} (each is looked for"
                    " in the payload's array: match on an id instead of a list)",
                    where,
                )
            stack.extend((v, depth + 1) for v in item)
    try:
        size = len(json.dumps(match, separators=(",", ":"), allow_nan=False, default=str).encode())
    except (ValueError, RecursionError):
        size = 0  # not JSON: check_json names what is wrong
    if size > MAX_MATCH_BYTES:
        raise _fail(f"match is {size} bytes of JSON; at most {MAX_MATCH_BYTES} (match on a few fields)", where)
    return dict(match)


def instant(value: Any, what: str, where: tuple[str | None, str | None]) -> str:
    """An instant as ISO 8601 with its offset (a naive one is UTC)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            raise _fail(f"{what} must be an ISO 8601 instant or a wall time HH:MM, not {value[:40]!r}", where) from None
    if not isinstance(value, dt.datetime):
        raise _fail(f"{what} must be a datetime, an ISO 8601 instant or a wall time HH:MM", where)
    moment: dt.datetime = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
    return moment.isoformat()


def _zone(tz: Any, where: tuple[str | None, str | None]) -> str:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not isinstance(tz, str) or not tz or len(tz) > 64:
        raise _fail(f"tz must be an IANA time zone name, not {str(tz)[:40]!r}", where)
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise _fail(f"unknown time zone {tz!r}", where) from None
    return tz


def timing(
    until: Any, delay: Any, tz: Any, where: tuple[str | None, str | None]
) -> dict[str, Any]:  # fmt: skip
    """``{"until": iso}``, ``{"at": "HH:MM", "tz": zone}``, ``{"delay": s}`` or ``{}``."""
    if until is not None and delay is not None:
        raise _fail("give until or delay, not both", where)
    if isinstance(until, str) and WALL_TIME_RE.fullmatch(until):
        return {"at": until, "tz": _zone(tz or "UTC", where)}
    if tz is not None and until is None:
        raise _fail("tz goes with a wall time until='HH:MM'", where)
    if until is not None:
        return {"until": instant(until, "until", where)}
    if delay is not None:
        return {"delay": check_seconds(delay, "delay", where, zero=True)}
    return {}


@dataclass(frozen=True)
class WaitSpec:
    """A wait node: ``kind`` event / sleep / approval, and its fields (see the module)."""

    kind: str
    event: str | None = None
    match: Mapping[str, Any] | None = None
    until: str | None = None
    at: str | None = None
    tz: str | None = None
    delay: float | None = None
    timeout: float | None = None
    on_timeout: str = "fail"
    lookback: float = DEFAULT_LOOKBACK

    @classmethod
    def make(
        cls,
        *,
        event: Any = None,
        match: Any = None,
        until: Any = None,
        delay: Any = None,
        tz: Any = None,
        timeout: Any = None,
        on_timeout: Any = "fail",
        lookback: Any = None,
        approval: bool = False,
        where: tuple[str | None, str | None] = (None, None),
    ) -> WaitSpec:
        if on_timeout not in ON_TIMEOUT:
            raise _fail(f"on_timeout must be 'fail' or 'skip', not {str(on_timeout)[:40]!r}", where)
        when = timing(until, delay, tz, where)
        given = sum(x for x in (event is not None, bool(when), approval))
        if given != 1:
            raise _fail(
                "a wait waits for one thing: an event (event=, match=), an instant (until= or delay=) or an approval",
                where,
            )
        if match is not None and event is None:
            raise _fail("match goes with event=", where)
        if lookback is not None and event is None:
            raise _fail("lookback goes with event=", where)
        kind = "event" if event is not None else "approval" if approval else "sleep"
        return cls(
            kind=kind,
            event=check_event_key(event, where) if event is not None else None,
            match=check_match(match, where),
            until=when.get("until"),
            at=when.get("at"),
            tz=when.get("tz"),
            delay=when.get("delay"),
            timeout=check_seconds(timeout, "timeout", where),
            on_timeout=str(on_timeout),
            lookback=DEFAULT_LOOKBACK if lookback is None else _lookback(lookback, where),
        )

    def checked(self, where: tuple[str | None, str | None] = (None, None)) -> WaitSpec:
        """This spec, if it is one :meth:`make` would build (a hand-built ``WaitSpec(...)`` is
        checked at submit like ``DAG.wait``'s); raises :class:`ValidationError` naming the node."""
        if self.kind not in KINDS:
            raise _fail(f"a wait's kind is one of {', '.join(KINDS)}, not {str(self.kind)[:40]!r}", where)
        if self.at is not None and self.until is not None:
            raise _fail("a wait has an instant (until) or a wall time (at), not both", where)
        try:
            made = WaitSpec.make(
                event=self.event, match=self.match, until=self.at if self.at is not None else self.until,
                delay=self.delay, tz=self.tz, timeout=self.timeout, on_timeout=self.on_timeout,
                lookback=self.lookback if self.kind == "event" else None, approval=self.kind == "approval",
                where=where,
            )  # fmt: skip
        except (TypeError, ValueError, AttributeError) as exc:
            why = f"not a valid WaitSpec ({type(exc).__name__}): build it with DAG.wait or WaitSpec.make"
            raise _fail(why, where) from exc
        if made != self:
            raise _fail(
                f"a hand-built WaitSpec must be as WaitSpec.make builds it (DAG.wait, DAG.approval): {self!r}"[:300],
                where,
            )
        return made

    def to_spec(self) -> dict[str, Any]:
        """The spec format's ``wait`` field."""
        spec: dict[str, Any] = {}
        if self.kind == "approval":
            spec["approval"] = True
        for name in ("event", "match", "until", "tz", "delay", "timeout"):
            value = getattr(self, name)
            if value is not None:
                spec[name] = dict(value) if name == "match" else value
        if self.at is not None:
            spec["until"] = self.at
        if self.on_timeout != "fail":
            spec["on_timeout"] = self.on_timeout
        if self.kind == "event" and self.lookback != DEFAULT_LOOKBACK:
            spec["lookback"] = self.lookback
        return spec

    def to_row(self) -> dict[str, Any]:
        """The task row's ``wait_spec`` (what ``orc_wait_v1`` reads)."""
        row: dict[str, Any] = {"kind": self.kind, "on_timeout": self.on_timeout}
        for name in ("event", "match", "until", "at", "tz", "delay", "timeout"):
            value = getattr(self, name)
            if value is not None:
                row[name] = dict(value) if name == "match" else value
        if self.kind == "event":
            row["lookback"] = self.lookback
        return row

    def describe(self) -> str:
        if self.kind == "event":
            return f"event {self.event}" + (f" matching {dict(self.match or {})}" if self.match else "")
        if self.kind == "approval":
            return "an approval"
        if self.at is not None:
            return f"{self.at} {self.tz}"
        return f"{self.until}" if self.until is not None else f"{self.delay:g}s"


def _lookback(value: Any, where: tuple[str | None, str | None]) -> float:
    return float(check_seconds(value, "lookback", where, zero=True) or 0.0)


WAIT_FIELDS = {"event", "match", "until", "tz", "delay", "timeout", "on_timeout", "lookback", "approval"}


def wait_from_spec(raw: Any, where: tuple[str | None, str | None]) -> WaitSpec:
    if not isinstance(raw, Mapping):
        raise _fail("'wait' must be a mapping: {event, match} | {until | delay} | {approval: true}", where)
    bad = set(raw) - WAIT_FIELDS
    if bad:
        raise _fail(f"unknown field(s) of 'wait' {sorted(map(str, bad))}", where)
    approval = raw.get("approval", False)
    if not isinstance(approval, bool):
        raise _fail("'wait.approval' must be true or false", where)
    return WaitSpec.make(
        event=raw.get("event"), match=raw.get("match"), until=raw.get("until"), delay=raw.get("delay"),
        tz=raw.get("tz"), timeout=raw.get("timeout"), on_timeout=raw.get("on_timeout", "fail"),
        lookback=raw.get("lookback"), approval=approval, where=where,
    )  # fmt: skip


@dataclass(frozen=True)
class SensorSpec:
    """A sensor: its check runs every ``every`` seconds (times ``backoff`` after each "not yet",
    at most ``max_every``) until it returns something truthy or ``timeout`` passes."""

    every: float
    timeout: float | None = None
    backoff: float = 1.0
    max_every: float | None = None
    on_timeout: str = "fail"

    @classmethod
    def make(
        cls, *, every: Any, timeout: Any = None, backoff: Any = 1.0, max_every: Any = None, on_timeout: Any = "fail",
        where: tuple[str | None, str | None] = (None, None),
    ) -> SensorSpec:  # fmt: skip
        if on_timeout not in ON_TIMEOUT:
            raise _fail(f"on_timeout must be 'fail' or 'skip', not {str(on_timeout)[:40]!r}", where)
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 1.0 <= backoff <= 10.0:
            raise _fail(f"backoff must be a factor from 1 to 10, not {str(backoff)[:40]!r}", where)
        every_s = check_seconds(every, "every", where)
        if every_s is None:
            raise _fail("every must be a number of seconds between checks, not null", where)
        most = check_seconds(max_every, "max_every", where)
        if most is not None and most < every_s:
            raise _fail("max_every must be at least every", where)
        return cls(every_s, check_seconds(timeout, "timeout", where), float(backoff), most, str(on_timeout))

    def checked(self, where: tuple[str | None, str | None] = (None, None)) -> SensorSpec:
        """This spec, if it is one :meth:`make` would build (a hand-built ``SensorSpec(...)`` is
        checked at submit like ``DAG.sensor``'s); raises :class:`ValidationError` naming the node."""
        try:
            made = SensorSpec.make(
                every=self.every, timeout=self.timeout, backoff=self.backoff, max_every=self.max_every,
                on_timeout=self.on_timeout, where=where,
            )  # fmt: skip
        except (TypeError, ValueError, AttributeError) as exc:
            raise _fail(f"not a valid SensorSpec ({type(exc).__name__}): build it with DAG.sensor", where) from exc
        if made != self:
            raise _fail(f"a hand-built SensorSpec must be as SensorSpec.make builds it: {self!r}"[:300], where)
        return made

    def interval(self, checks: int) -> float:
        """Seconds before check number ``checks + 1`` (after ``checks`` said "not yet")."""
        value = self.every * self.backoff ** max(0, checks - 1)
        return min(value, self.max_every) if self.max_every is not None else min(value, MAX_SECONDS)

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"every": self.every}
        if self.timeout is not None:
            spec["timeout"] = self.timeout
        if self.backoff != 1.0:
            spec["backoff"] = self.backoff
        if self.max_every is not None:
            spec["max_every"] = self.max_every
        if self.on_timeout != "fail":
            spec["on_timeout"] = self.on_timeout
        return spec

    def to_row(self) -> dict[str, Any]:
        return {"kind": "sensor", **self.to_spec(), "on_timeout": self.on_timeout}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SensorSpec:
        return cls(
            float(row["every"]), row.get("timeout"), float(row.get("backoff", 1.0)), row.get("max_every"),
            str(row.get("on_timeout", "fail")),
        )  # fmt: skip


SENSOR_FIELDS = {"every", "timeout", "backoff", "max_every", "on_timeout"}


def sensor_from_spec(raw: Any, where: tuple[str | None, str | None]) -> SensorSpec:
    if not isinstance(raw, Mapping) or "every" not in raw:
        raise _fail("'sensor' must be a mapping with 'every' (seconds between checks)", where)
    bad = set(raw) - SENSOR_FIELDS
    if bad:
        raise _fail(f"unknown field(s) of 'sensor' {sorted(map(str, bad))}", where)
    return SensorSpec.make(
        every=raw["every"], timeout=raw.get("timeout"), backoff=raw.get("backoff", 1.0),
        max_every=raw.get("max_every"), on_timeout=raw.get("on_timeout", "fail"), where=where,
    )  # fmt: skip


class Defer(Exception):
    """Raised inside an orchestrated task body: give the worker slot back and wait (``WAITING``)
    until ``until`` (an instant) / ``delay`` seconds pass, or an ``event`` whose payload contains
    ``match`` comes (an event of the run's tenant, or a signal to the run: ``run.signal``), at
    most ``timeout`` seconds (then the task FAILS with ``WaitTimeout``, or is SKIPPED with
    ``on_timeout="skip"``). The task is then called again, with one more attempt allowed (its
    retry budget untouched) and ``current_context().resumed == {"event": payload or None,
    "state": state}``: Airflow's ``next_method`` / ``next_kwargs`` without a triggerer."""

    def __init__(
        self,
        until: Any = None,
        delay: Any = None,
        event: str | None = None,
        match: Mapping[str, Any] | None = None,
        timeout: Any = None,
        state: Any = None,
        *,
        on_timeout: str = "fail",
        lookback: Any = None,
    ) -> None:
        super().__init__("deferred")
        self.until, self.delay, self.event, self.match = until, delay, event, match
        self.timeout, self.state, self.on_timeout, self.lookback = timeout, state, on_timeout, lookback

    def spec(self) -> dict[str, Any]:
        """What ``orc_defer_v1`` gets; raises :class:`ValidationError` naming a bad field."""
        where: tuple[str | None, str | None] = (None, None)
        if self.on_timeout not in ON_TIMEOUT:
            raise ValidationError(f"Defer: on_timeout must be 'fail' or 'skip', not {str(self.on_timeout)[:40]!r}")
        when = timing(self.until, self.delay, None, where)
        if self.event is None and not when:
            raise ValidationError("Defer needs until=, delay= or event= (what to wait for)")
        if self.event is None and self.match is not None:
            raise ValidationError("Defer: match goes with event=")
        out: dict[str, Any] = {"kind": "defer", "on_timeout": self.on_timeout, **when}
        if self.event is not None:
            out["event"] = check_event_key(self.event, where)
            if self.match is not None:
                out["match"] = check_match(self.match, where)
            out["lookback"] = (
                DEFAULT_LOOKBACK
                if self.lookback is None
                else check_seconds(self.lookback, "lookback", where, zero=True)
            )
        timeout = check_seconds(self.timeout, "timeout", where)
        if timeout is not None:
            out["timeout"] = timeout
        if self.state is not None:
            out["state"] = self.state  # checked as JSON by the worker before it is written
        return out
