"""Keyed flow control (pure code): the options ``submit(..., concurrency_key="customer:42",
max_concurrent=1, on_busy="queue", throttle="10/minute", debounce=30, max_wait=300)`` checked
before anything is written, as the :class:`FlowControl` a run keeps (``orc_runs.flow``).

A key is per tenant. ``max_concurrent`` runs of a key may be admitted (not held, not final) at
once; ``on_busy`` says what a submit to a busy key does: ``queue`` (held until the key frees),
``skip`` (the new run is cancelled at once, recorded), ``cancel_running`` (the admitted runs of
the key are cancelled and the runs it holds replaced: the new one runs when they are final) or
``replace_queued`` (the runs the key holds are cancelled, the new one is held in their place).
``throttle="N/period"`` admits at most N runs of the key per period (the rest wait their turn,
never dropped). ``debounce`` (seconds) holds the run until the key has been quiet that long: a newer submit to the key
replaces it, keeping the burst's first instant, and ``max_wait`` bounds how long a burst waits.
``batch=(100, "5s")`` gathers submissions: the first of the key opens a held run, the next ones
(up to 100 events, within 5 s of the first) are merged into it, their ``events`` param lists
appended to its own (:data:`BATCH_PARAM`; event triggers submit ``events=[payload]``).
The decisions are the store's (:mod:`orchestrator.store.flow`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypedDict

from .errors import ValidationError

#: what a submit to a busy key does
ON_BUSY = ("queue", "skip", "cancel_running", "replace_queued")

#: a concurrency key: 1-200 characters of letters, digits and ``_ . : / - @ =``
KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@=-]{0,199}")

#: the periods a throttle may name, in seconds
PERIODS = {"second": 1, "sec": 1, "s": 1, "minute": 60, "min": 60, "m": 60, "hour": 3600, "h": 3600, "day": 86400}

RATE_RE = re.compile(r"\s*(\d{1,6})\s*/\s*(\d{0,6})\s*([a-z]+)\s*")
DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*")

#: the param a batched run holds its events in (a list; a submission without one is one event: its params)
BATCH_PARAM = "events"

#: the most events one batch may hold
MAX_BATCH = 10000

#: the longest debounce, ``max_wait`` or throttle period (a day)
MAX_SECONDS = 86400.0


class FlowControlError(ValidationError):
    """A flow-control option is wrong (raised before anything is written)."""


class FlowOptions(TypedDict, total=False):
    """The keyword arguments of keyed flow control that ``submit`` takes."""

    concurrency_key: str | None
    max_concurrent: int | None
    on_busy: str | None
    throttle: str | None
    debounce: float | str | None
    max_wait: float | str | None
    batch: Any


@dataclass(frozen=True)
class FlowControl:
    """A run's checked flow control (``orc_runs.flow`` holds :meth:`to_row`)."""

    key: str
    max_concurrent: int | None = None
    on_busy: str = "queue"
    throttle: tuple[int, float] | None = None  # (runs, period in seconds)
    debounce: float | None = None
    max_wait: float | None = None
    batch: tuple[int, float] | None = None  # (most events, window in seconds)

    def to_row(self) -> dict[str, Any]:
        return {
            "max_concurrent": self.max_concurrent,
            "on_busy": self.on_busy,
            "throttle": list(self.throttle) if self.throttle else None,
            "debounce": self.debounce,
            "max_wait": self.max_wait,
            "batch": list(self.batch) if self.batch else None,
        }

    @classmethod
    def from_row(cls, key: str, row: dict[str, Any]) -> FlowControl:
        throttle, batch = row.get("throttle"), row.get("batch")
        return cls(
            key=key,
            max_concurrent=row.get("max_concurrent"),
            on_busy=row.get("on_busy") or "queue",
            throttle=(int(throttle[0]), float(throttle[1])) if throttle else None,
            debounce=row.get("debounce"),
            max_wait=row.get("max_wait"),
            batch=(int(batch[0]), float(batch[1])) if batch else None,
        )


def parse_rate(rate: Any) -> tuple[int, float]:
    """``"10/minute"`` -> ``(10, 60.0)``; also ``"5/s"``, ``"100/2h"``. Raises :class:`FlowControlError`."""
    match = RATE_RE.fullmatch(rate) if isinstance(rate, str) else None
    unit = PERIODS.get(match.group(3)) if match else None
    if match is None or unit is None:
        raise FlowControlError(f"throttle {rate!r} is not a rate such as '10/minute', '5/s' or '100/2h'")
    runs, many = int(match.group(1)), int(match.group(2) or 1)
    if runs < 1 or many < 1 or unit * many > MAX_SECONDS:
        raise FlowControlError(f"throttle {rate!r}: at least 1 run per period, and a period of at most a day")
    return runs, float(unit * many)


def parse_duration(value: Any, what: str) -> float:
    """Seconds from a number or ``"30s"``, ``"500ms"``, ``"5m"``, ``"1h"`` (above 0, at most a day)."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := DURATION_RE.fullmatch(value)):
        seconds = float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise FlowControlError(f"{what} {value!r} is not a duration above 0 and at most a day (30, '30s', '5m')")
    return seconds


def parse_batch(value: Any) -> tuple[int, float]:
    """``(100, "5s")`` -> ``(100, 5.0)``: at most that many events, or that long since the first."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise FlowControlError(f"batch {value!r} is not (most events, window) such as (100, '5s')")
    most, window = value
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_BATCH:
        raise FlowControlError(f"batch size must be an int from 1 to {MAX_BATCH}, not {most!r}")
    return most, parse_duration(window, "batch window")


def check_flow(options: FlowOptions) -> FlowControl | None:
    """The checked :class:`FlowControl` of ``submit``'s flow options, ``None`` without a key;
    :class:`FlowControlError` naming the first wrong one."""
    key = options.get("concurrency_key")
    given = sorted(k for k, v in options.items() if v is not None and k != "concurrency_key")
    unknown = sorted(set(options) - set(FlowOptions.__annotations__))
    if unknown:
        raise FlowControlError(f"unknown flow-control option {unknown[0]!r}")
    if key is None:
        if given:
            raise FlowControlError(f"{given[0]} needs a concurrency_key (flow control is per key)")
        return None
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise FlowControlError(
            f"concurrency_key {key!r} must be 1-200 letters, digits or '_ . : / - @ =' (such as 'customer:42')"
        )
    most = options.get("max_concurrent")
    if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < 1):
        raise FlowControlError(f"max_concurrent must be an int of at least 1, not {most!r}")
    on_busy = options.get("on_busy") or "queue"
    if on_busy not in ON_BUSY:
        raise FlowControlError(f"on_busy {on_busy!r} is not one of {', '.join(ON_BUSY)}")
    throttle = options.get("throttle")
    debounce, max_wait = options.get("debounce"), options.get("max_wait")
    if max_wait is not None and debounce is None:
        raise FlowControlError("max_wait bounds a debounce: give debounce too")
    batch = options.get("batch")
    if batch is not None and (debounce is not None or on_busy != "queue"):
        raise FlowControlError("batch gathers submissions into one run: not with debounce or an on_busy policy")
    if most is None and throttle is None and debounce is None and batch is None:
        most = 1  # a key alone: one run at a time (celery-once's lock)
    flow = FlowControl(
        key=key,
        max_concurrent=most,
        on_busy=on_busy,
        throttle=parse_rate(throttle) if throttle is not None else None,
        debounce=parse_duration(debounce, "debounce") if debounce is not None else None,
        max_wait=parse_duration(max_wait, "max_wait") if max_wait is not None else None,
        batch=parse_batch(batch) if batch is not None else None,
    )
    if flow.debounce is not None and flow.max_wait is not None and flow.max_wait < flow.debounce:
        raise FlowControlError(f"max_wait ({flow.max_wait:g}s) is shorter than the debounce ({flow.debounce:g}s)")
    return flow
