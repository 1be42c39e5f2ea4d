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
from itertools import islice
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from .errors import ValidationError

UTC = dt.UTC
DST_GAP = ("shift", "skip")
DST_FOLD = ("first", "last", "both")
#: the shortest and longest interval of an ``every`` schedule, in seconds
MIN_EVERY = 1.0
MAX_EVERY = 366 * 86400.0
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
#: how far ahead a schedule's next instant is looked for: eight years, so that a leap-day cron
#: (``0 0 29 2 *``) always finds its next 29 February (2096's next is 2104's: 2100 is no leap year)
HORIZON = dt.timedelta(days=8 * 366)
#: the stretch of time :func:`instants` reads at once
_CHUNK = dt.timedelta(days=7)


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
    """The schedule's instants in ``(after, until]`` (aware datetimes), in UTC, strictly increasing.

    Lazy: the range is walked a week at a time (an empty stretch of a sparse cron is skipped),
    so taking the first few of a long range, or counting with a bound, costs what it reads."""
    after, until = after.astimezone(UTC), until.astimezone(UTC)
    if timing.every is not None:
        period = float(timing.every)
        first, last = _every_range(period, after, until)
        for k in range(first, last + 1):
            yield _every_at(period, k)
        return
    zone = timing.zone
    lo = after
    while lo < until:
        ahead = _next_stretch(timing, zone, lo)
        if ahead is None or ahead >= until:
            return
        lo = max(lo, ahead)
        hi = min(lo + _CHUNK, until)
        yield from _cron_window(timing, zone, lo, hi)
        lo = hi


def _every_at(period: float, k: int) -> dt.datetime:
    return EPOCH + dt.timedelta(seconds=k * period)


def _every_range(period: float, after: dt.datetime, until: dt.datetime) -> tuple[int, int]:
    """The first and last ``k`` whose multiple ``k * period`` is in ``(after, until]`` (``hi < lo``:
    none); the float division is only a guess, checked against the instants themselves."""
    lo = int((after - EPOCH).total_seconds() // period) + 1
    while _every_at(period, lo - 1) > after:
        lo -= 1
    while _every_at(period, lo) <= after:
        lo += 1
    hi = int((until - EPOCH).total_seconds() // period)
    while _every_at(period, hi + 1) <= until:
        hi += 1
    while hi >= lo and _every_at(period, hi) > until:
        hi -= 1
    return lo, hi


def _next_stretch(timing: Timing, zone: ZoneInfo, lo: dt.datetime) -> dt.datetime | None:
    """A point before which no instant after ``lo`` lies: three days before the next wall-clock
    time the expression matches (so that a leap-day cron skips its empty years instead of
    walking them a week at a time); ``None`` when it never matches again."""
    assert timing.cron is not None
    start = lo.astimezone(zone).replace(tzinfo=None) - dt.timedelta(days=2)
    try:
        wall: dt.datetime = croniter(timing.cron, start).get_next(dt.datetime)
    except CroniterError:  # refused at add (check_timing); only a row changed by hand gets here
        return None
    return (wall - dt.timedelta(days=3)).replace(tzinfo=zone).astimezone(UTC)


def _cron_window(timing: Timing, zone: ZoneInfo, after: dt.datetime, until: dt.datetime) -> Iterator[dt.datetime]:
    """The cron instants in ``(after, until]``, a range of at most :data:`_CHUNK`. Croniter walks
    naive wall-clock times, so it never meets a transition. Where the zone's offset is the same
    all around the range, wall time is UTC shifted: the walk yields as it goes. Near a
    transition, a day at a time, it walks from a day before to a day after (a fold can put a
    later wall time earlier in UTC, a gap an earlier one later) and sorts what it found."""
    assert timing.cron is not None
    local_after = after.astimezone(zone).replace(tzinfo=None)
    local_until = until.astimezone(zone).replace(tzinfo=None)
    if _fixed_offset(zone, after - dt.timedelta(days=1), until + dt.timedelta(days=1)):
        walk = croniter(timing.cron, local_after)
        while True:
            wall = walk.get_next(dt.datetime)
            if wall > local_until:
                return
            yield wall.replace(tzinfo=zone).astimezone(UTC)
    if until - after > dt.timedelta(days=1):  # the slow way, a day at a time
        lo = after
        while lo < until:
            hi = min(lo + dt.timedelta(days=1), until)
            yield from _cron_window(timing, zone, lo, hi)
            lo = hi
        return
    walk = croniter(timing.cron, local_after - dt.timedelta(days=1))
    stop = local_until + dt.timedelta(days=1)
    pending: list[dt.datetime] = []
    while True:
        wall = walk.get_next(dt.datetime)
        if wall > stop:
            break
        pending.extend(resolve(wall, zone, timing.dst_gap, timing.dst_fold))
    last: dt.datetime | None = None
    for at in sorted(set(pending)):
        if after < at <= until and (last is None or at > last):
            last = at
            yield at


def _fixed_offset(zone: ZoneInfo, lo: dt.datetime, hi: dt.datetime) -> bool:
    """Whether ``zone``'s UTC offset is the same from ``lo`` to ``hi`` (looked at every half
    hour: no zone changes its offset twice within that)."""
    first = lo.astimezone(zone).utcoffset()
    at = lo
    while at < hi:
        at = min(at + dt.timedelta(minutes=30), hi)
        if at.astimezone(zone).utcoffset() != first:
            return False
    return True


def next_instant(timing: Timing, after: dt.datetime) -> dt.datetime | None:
    """The first instant strictly after ``after`` (within :data:`HORIZON`, eight years), or ``None``."""
    for at in instants(timing, after, after + HORIZON):
        return at
    return None


def previous_instant(timing: Timing, before: dt.datetime) -> dt.datetime | None:
    """The last instant at or before ``before`` (within :data:`HORIZON`), or ``None``."""
    found = last_instants(timing, before - HORIZON, before, 1)
    return found[-1] if found else None


def last_instants(timing: Timing, after: dt.datetime, until: dt.datetime, n: int) -> list[dt.datetime]:
    """The last ``n`` instants in ``(after, until]``, oldest first, read backwards from ``until``
    (an hour, then stretches twice as long, up to a week): what it costs does not grow with the
    length of the range."""
    after, until = after.astimezone(UTC), until.astimezone(UTC)
    if n <= 0:
        return []
    if timing.every is not None:
        period = float(timing.every)
        first, last = _every_range(period, after, until)
        return [_every_at(period, k) for k in range(max(first, last - n + 1), last + 1)]
    found: list[dt.datetime] = []
    hi, span = until, dt.timedelta(hours=1)
    while hi > after and len(found) < n:
        lo = max(after, hi - span)
        found[:0] = instants(timing, lo, hi)
        hi, span = lo, min(span * 2, _CHUNK)
    return found[-n:]


def count_instants(timing: Timing, after: dt.datetime, until: dt.datetime, most: int) -> int:
    """How many instants ``(after, until]`` holds, counted up to ``most``: the exact count, or
    ``most`` when there are at least that many (an interval schedule's count is always exact)."""
    if timing.every is not None:
        first, last = _every_range(float(timing.every), after.astimezone(UTC), until.astimezone(UTC))
        return max(last - first + 1, 0)
    return sum(1 for _ in islice(instants(timing, after, until), most))
