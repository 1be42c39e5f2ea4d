"""What a test puts into a kit's run besides its DAG: faults (:class:`FailTimes`, :class:`LoseDispatch`,
:class:`CrashWorker`) and inputs from outside (:func:`emit`, :func:`signal`, :func:`approve`,
:func:`reject`), given to :func:`run_dag` and acted on at the instant the run reaches them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class KitError(AssertionError):
    """The kit could not do what the test asked (an unknown task, a run that never settles)."""


class Fault:
    """A fault injected into the first ``times`` deliveries of a node's messages."""

    def __init__(self, times: int = 1) -> None:
        if times < 0:
            raise ValueError("times must not be negative")
        self.times = times
        self.used = 0

    def take(self) -> bool:
        if self.used < self.times:
            self.used += 1
            return True
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(times={self.times}, used={self.used})"


class FailTimes(Fault):
    """The body raises ``exc`` (a class or an instance) on its first ``times`` attempts, instead
    of running; the worker records the failure as it would any other (retry with the node's
    backoff, ``retry_on``/``no_retry_on``, poison detection)."""

    def __init__(self, times: int, exc: type[BaseException] | BaseException = RuntimeError, message: str = "") -> None:
        super().__init__(times)
        self.exc = exc
        self.message = message

    def error(self) -> BaseException:
        if isinstance(self.exc, BaseException):
            return self.exc
        return self.exc(self.message or f"injected by FailTimes({self.times}): failure {self.used} of {self.times}")

    def __repr__(self) -> str:
        name = self.exc.__name__ if isinstance(self.exc, type) else type(self.exc).__name__
        return f"FailTimes({self.times}, exc={name}, used={self.used})"


class LoseDispatch(Fault):
    """The broker loses the node's message (published, never delivered): the task stays QUEUED
    until the reconciler re-publishes it past ``dispatch_timeout`` (the clock jumps there)."""


class CrashWorker(Fault):
    """The worker dies right after its claim: the attempt is RUNNING and never finishes, until
    its lease expires (the clock jumps there) and the reconciler fails it (``LeaseExpired``: a
    retry when attempts remain; ``crash_loop_threshold`` lost leases in a row: DEAD_LETTER)."""


def _faults(faults: Mapping[str, Fault | Sequence[Fault]] | None) -> dict[str, list[Fault]]:
    out: dict[str, list[Fault]] = {}
    for name, value in (faults or {}).items():
        items = [value] if isinstance(value, Fault) else list(value)
        for f in items:
            if not isinstance(f, Fault):
                raise TypeError(f"faults[{name!r}] holds {f!r}: give FailTimes, LoseDispatch or CrashWorker")
        out[name] = items
    return out


@dataclass(frozen=True)
class Input:
    """An event, a signal or an answer to an approval that a drive delivers (see :func:`emit`)."""

    kind: str
    key: str
    payload: dict[str, Any] | None = None
    event_id: str | None = None
    tenant: str | None = None
    by: str = "test"
    comment: str | None = None
    #: seconds of virtual time after the run's start; ``None``: once something waits for it
    after: float | None = None


def _after(after: float | dt.timedelta | None) -> float | None:
    return after.total_seconds() if isinstance(after, dt.timedelta) else after


def emit(
    key: str,
    payload: dict[str, Any] | None = None,
    *,
    event_id: str | None = None,
    tenant: str | None = None,
    after: float | dt.timedelta | None = None,
) -> Input:
    """The event ``key`` for ``run_dag(events=[...])``: emitted (:meth:`Orchestrator.emit`) once a
    task waits for it, or ``after`` seconds of virtual time after the run started."""
    return Input("emit", key, payload, event_id, tenant, after=_after(after))


def signal(
    name: str, payload: dict[str, Any] | None = None, *, event_id: str | None = None,
    after: float | dt.timedelta | None = None,
) -> Input:  # fmt: skip
    """The signal ``name`` to the run, for ``run_dag(events=[...])`` (delivered as :func:`emit`)."""
    return Input("signal", name, payload, event_id, after=_after(after))


def approve(
    key: str, *, by: str = "test", comment: str | None = None, after: float | dt.timedelta | None = None
) -> Input:
    """An approval of the node ``key``, for ``run_dag(events=[...])``: given once it waits for one."""
    return Input("approve", key, by=by, comment=comment, after=_after(after))


def reject(
    key: str, *, by: str = "test", comment: str | None = None, after: float | dt.timedelta | None = None
) -> Input:
    """A rejection of the approval node ``key`` (delivered as :func:`approve`)."""
    return Input("reject", key, by=by, comment=comment, after=_after(after))
