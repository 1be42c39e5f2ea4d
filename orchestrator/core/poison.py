"""Failure fingerprints, retry classification and the verdict on a failed attempt (pure code).

A fingerprint is the exception type plus the innermost frame of the task's own code (file,
function, line) plus the message with numbers and ids stripped, hashed. The same fingerprint
on ``threshold`` consecutive attempts means the task is poisoned: DEAD_LETTER, not a retry.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
import traceback
from collections.abc import Iterable, Sequence
from types import TracebackType

from .states import TaskState

_LIBRARY_DIRS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
)
#: the orchestrator package (this module is in its core/ floor): its frames are never task code
_OWN_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_VOLATILE = re.compile(
    r"0x[0-9a-fA-F]+|[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
    r"|[0-9a-fA-F]{32}|\d+(?:\.\d+)?"
)


def normalize_message(message: str) -> str:
    """The message with numbers, hex and uuid-like ids replaced by ``#``."""
    return _VOLATILE.sub("#", message)[:500]


def _is_task_code(filename: str) -> bool:
    path = os.path.realpath(filename)
    if path.startswith(_OWN_PACKAGE + os.sep):
        return False
    return not any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS)


def innermost_frame(tb: TracebackType | None) -> tuple[str, str, int] | None:
    """(file, function, line) of the innermost frame in the task's own code, else the innermost."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if _is_task_code(frame.filename):
            return os.path.basename(frame.filename), frame.name, frame.lineno or 0
    if frames:
        last = frames[-1]
        return os.path.basename(last.filename), last.name, last.lineno or 0
    return None


def exception_names(exc: BaseException) -> list[str]:
    """Every class of ``exc``'s MRO by bare and qualified name (for retry_on / no_retry_on)."""
    names: list[str] = []
    for cls in type(exc).__mro__:
        if cls is object:
            break
        names.extend((cls.__name__, f"{cls.__module__}.{cls.__qualname__}"))
    return names


def fingerprint(exc: BaseException) -> tuple[str, str]:
    """(hash, evidence) of a failure; the evidence is the readable text that was hashed."""
    cls = type(exc)
    frame = innermost_frame(exc.__traceback__)
    where = f"{frame[0]}:{frame[1]}:{frame[2]}" if frame else "?"
    evidence = f"{cls.__module__}.{cls.__qualname__} at {where}: {normalize_message(str(exc))}"
    return hashlib.sha256(evidence.encode()).hexdigest()[:32], evidence


#: exception class names of infrastructure faults (database, broker, network): a task that
#: meets one keeps retrying; it never counts toward poison, an outage is not a bug in the task
INFRASTRUCTURE = frozenset(
    {
        "sqlalchemy.exc.OperationalError",
        "sqlalchemy.exc.InterfaceError",
        "psycopg.OperationalError",
        "psycopg.errors.OperationalError",
        "redis.exceptions.ConnectionError",
        "redis.exceptions.TimeoutError",
        "kombu.exceptions.OperationalError",
        "builtins.ConnectionError",
    }
)


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` is (a subclass of) a database, broker or connection error."""
    return any(name in INFRASTRUCTURE for name in exception_names(exc))


def is_retryable(names: Iterable[str], retry_on: Sequence[str] | None, no_retry_on: Sequence[str] | None) -> bool:
    """``no_retry_on`` wins; a non-empty ``retry_on`` retries only what it names."""
    have = set(names)
    if no_retry_on and have & set(no_retry_on):
        return False
    return not retry_on or bool(have & set(retry_on))


def verdict(
    *,
    attempt: int,
    max_attempts: int,
    retryable: bool,
    streak: int,
    threshold: int,
) -> TaskState:
    """What a failed attempt becomes: DEAD_LETTER when the same failure repeated ``threshold``
    times in a row, RETRYING while retryable with attempts left, FAILED otherwise."""
    if not retryable:
        return TaskState.FAILED
    if threshold > 0 and streak >= threshold:
        return TaskState.DEAD_LETTER
    if attempt < max_attempts:
        return TaskState.RETRYING
    return TaskState.FAILED
