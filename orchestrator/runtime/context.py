"""What an orchestrated task body may know about itself: :class:`TaskContext`, set by the worker
around each attempt's body and read with :func:`current_context`."""

from __future__ import annotations

import contextvars
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TaskContext:
    """What an orchestrated task body may know about itself (see :func:`current_context`)."""

    run_id: str
    key: str
    attempt: int
    upstream: dict[str, Any] = field(default_factory=dict)
    #: reads the run's logical date (one query, the first time it is asked)
    lookup: Callable[[str], str | None] | None = field(default=None, repr=False, compare=False)
    #: a body called again after it raised :class:`orchestrator.Defer`: ``{"event": the payload
    #: that woke it, or None; "state": what it saved; "timed_out": False}``; None on a first call
    resumed: dict[str, Any] | None = None
    #: records a progress report of this attempt (:mod:`orchestrator.runtime.progress`)
    reporter: Callable[[str, Any], None] | None = field(default=None, repr=False, compare=False)
    #: a ``transactional=True`` node's attempt: a SQLAlchemy ``Connection`` to the orchestrator's
    #: database inside the transaction that will commit the attempt's success; the body's writes
    #: on it commit with that success, or roll back when the attempt is fenced or fails. Never
    #: commit, roll back or close it in the body. ``None`` for any other task.
    transaction: Any = field(default=None, repr=False, compare=False)

    def progress(self, meta: Any = None, *, state: str = "PROGRESS") -> None:
        """Report this attempt's progress, as Celery's ``self.update_state(state=state, meta=meta)``
        does: ``meta`` plain JSON (at most ``ORCHESTRATOR_MAX_PROGRESS_BYTES``), ``state`` 1-64
        characters. The latest report is shown by ``status``, ``watch``, the run page and the API;
        reports closer together than ``ORCHESTRATOR_PROGRESS_INTERVAL`` keep only the latest,
        written when the interval is up or before the attempt's outcome. Raises
        :class:`~orchestrator.ValidationError` for bad input; a report the database cannot take
        is logged, never raised."""
        if self.reporter is not None:
            self.reporter(state, meta)

    @property
    def logical_date(self) -> dt.datetime | None:
        """The run's logical date (a schedule's instant, in UTC), or ``None`` for a run that has none."""
        found = _logical_dates.get(self.run_id)
        if found is None and self.lookup is not None:
            found = _logical_dates[self.run_id] = self.lookup(self.run_id) or ""
        return dt.datetime.fromisoformat(found) if found else None


#: run id -> logical date ("" for none), per process: a run's logical date never changes
_logical_dates: dict[str, str] = {}


_context: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar("orc_context", default=None)


def current_context() -> TaskContext | None:
    """The running orchestrated task's context, or ``None`` outside a DAG."""
    return _context.get()
