"""When a schedule fires (pure code): cron expressions in an IANA time zone with an explicit DST
policy, and fixed intervals in absolute time.

A cron schedule names *wall-clock* times in its zone. :func:`instants` walks the wall-clock times
the expression matches (croniter over naive datetimes, so croniter never sees a DST transition)
and turns each into UTC instants with the schedule's policy:

- a wall time that does not exist (the spring-forward gap): ``dst_gap="shift"`` (default) fires
  once, at the instant PEP 495 gives that wall time with ``fold=0`` (the offset before the
  transition: 02:30 on 2026-03-08 in America/New_York is 07:30 UTC, which is also 03:30 EDT);
  ``"skip"`` does not fire;
- a wall time that happens twice (fall back): ``dst_fold="first"`` (default) fires at the first
  occurrence (01:30 EDT on 2026-11-01, 05:30 UTC), ``"last"`` at the second (01:30 EST, 06:30 UTC),
  ``"both"`` at both.

Instants are returned strictly increasing: two wall times that land on the same instant (a
shifted gap time and the real time it equals) fire once. An interval schedule (``every``
seconds) fires at the multiples of its period since the Unix epoch, in absolute time, whatever
the zone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from .errors import ValidationError

UTC = dt.UTC
DST_GAP = ("shift", "skip")
DST_FOLD = ("first", "last", "both")
#: the shortest and longest interval of an ``every`` schedule, in seconds
MIN_EVERY = 1.0
MAX_EVERY = 366 * 86400.0
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


class ScheduleError(ValidationError):
    """A schedule's timing is malformed: a bad cron expression, an unknown zone, a bad interval
    or policy."""


@dataclass(frozen=True)
class Timing:
    """When a schedule fires: ``cron`` (5 fields) in ``tz``, or every ``every`` seconds."""

    cron: str | None = None
    every: float | None = None
    tz: str = "UTC"
    dst_gap: str = "shift"
    dst_fold: str = "first"

    def __post_init__(self) -> None:
        check_timing(self)

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)

    def describe(self) -> str:
        return f"cron {self.cron!r} {self.tz}" if self.cron is not None else f"every {self.every:g}s"


def check_timing(t: Timing) -> None:
    """Raise :class:`ScheduleError` naming what is wrong with ``t``."""
    if (t.cron is None) == (t.every is None):
        raise ScheduleError("give a cron expression or an interval in seconds (one of them)")
    if not isinstance(t.tz, str) or not t.tz or len(t.tz) > 64:
        raise ScheduleError(f"unknown time zone {t.tz!r}")
    try:
        ZoneInfo(t.tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"unknown time zone {t.tz!r} (an IANA name such as America/New_York)") from None
    if t.dst_gap not in DST_GAP:
        raise ScheduleError(f"dst_gap must be one of {', '.join(DST_GAP)}, not {t.dst_gap!r}")
    if t.dst_fold not in DST_FOLD:
        raise ScheduleError(f"dst_fold must be one of {', '.join(DST_FOLD)}, not {t.dst_fold!r}")
    if t.every is not None:
        if isinstance(t.every, bool) or not isinstance(t.every, (int, float)) or not MIN_EVERY <= t.every <= MAX_EVERY:
            raise ScheduleError(
                f"every must be a number of seconds from {MIN_EVERY:g} to {MAX_EVERY:g}, not {t.every!r}"
            )
        return
    cron = t.cron
    if not isinstance(cron, str) or len(cron) > 200:
        raise ScheduleError(f"cron expression {cron!r} is not a string of at most 200 characters")
    fields = cron.split()
    if len(fields) != 5:
        raise ScheduleError(
            f"cron expression {cron!r} must have 5 fields (minute hour day-of-month month day-of-week),"
            f" not {len(fields)}"
        )
    if not croniter.is_valid(cron):
        raise ScheduleError(f"cron expression {cron!r} is not valid")
    try:
        croniter(cron, dt.datetime(2026, 1, 1)).get_next(dt.datetime)
    except Exception as exc:  # noqa: BLE001 - croniter's CroniterBadDateError and friends: it never matches
        raise ScheduleError(f"cron expression {cron!r} never fires ({exc})") from None


def resolve(wall: dt.datetime, zone: ZoneInfo, dst_gap: str, dst_fold: str) -> list[dt.datetime]:
    """The UTC instants of the naive wall-clock time ``wall`` in ``zone`` under the DST policy."""
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    a, b = first.astimezone(UTC), second.astimezone(UTC)
    exists = a.astimezone(zone).replace(tzinfo=None) == wall
    if not exists:  # the gap: the wall time never shows on a clock of this zone
        return [a] if dst_gap == "shift" else []
    if a == b:
        return [a]
    # the fold: the wall time shows twice (fold=0 the first, earlier instant)
    early, late = min(a, b), max(a, b)
    return {"first": [early], "last": [late], "both": [early, late]}[dst_fold]


def instants(timing: Timing, after: dt.datetime, until: dt.datetime) -> Iterator[dt.datetime]:
    """The schedule's instants in ``(after, until]`` (aware datetimes), in UTC, strictly increasing."""
    after, until = after.astimezone(UTC), until.astimezone(UTC)
    if timing.every is not None:
        period = float(timing.every)
        k = int((after - EPOCH).total_seconds() // period) + 1
        while True:
            at = EPOCH + dt.timedelta(seconds=k * period)
            if at > until:
                return
            if at > after:
                yield at
            k += 1
    zone = timing.zone
    # wall-clock times from a day before ``after`` (a fold can put a later wall time earlier in
    # UTC); croniter walks naive times, so it never meets a transition
    start = after.astimezone(zone).replace(tzinfo=None) - dt.timedelta(days=1)
    walk = croniter(timing.cron, start)
    last: dt.datetime | None = None
    stop = until.astimezone(zone).replace(tzinfo=None) + dt.timedelta(days=1)
    pending: list[dt.datetime] = []
    while True:
        wall = walk.get_next(dt.datetime)
        if wall > stop:
            break
        pending.extend(resolve(wall, zone, timing.dst_gap, timing.dst_fold))
    for at in sorted(set(pending)):
        if after < at <= until and (last is None or at > last):
            last = at
            yield at


def next_instant(timing: Timing, after: dt.datetime) -> dt.datetime | None:
    """The first instant strictly after ``after`` (within a year and a day), or ``None``."""
    horizon = after + dt.timedelta(days=367)
    # look a week at a time: most schedules fire within the first
    lo = after
    while lo < horizon:
        hi = min(lo + dt.timedelta(days=7), horizon)
        for at in instants(timing, lo, hi):
            return at
        lo = hi
    return None


def previous_instant(timing: Timing, before: dt.datetime) -> dt.datetime | None:
    """The last instant at or before ``before`` (within a year and a day), or ``None``."""
    lo = before
    floor = before - dt.timedelta(days=367)
    while lo > floor:
        start = max(lo - dt.timedelta(days=7), floor)
        found = list(instants(timing, start, lo))
        if found:
            return found[-1]
        lo = start
    return None
