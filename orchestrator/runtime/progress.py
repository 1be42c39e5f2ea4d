"""Progress reports of running attempts: Celery's ``self.update_state(state=..., meta=...)`` and
``current_context().progress(...)`` inside an orchestrated body, recorded in ``orc_progress``
(:meth:`~orchestrator.engine.Orchestrator.record_progress`: fenced by attempt, size-bounded).

A tight loop of reports cannot flood the database: per attempt, at most one write per
``ORCHESTRATOR_PROGRESS_INTERVAL`` seconds. A report inside the interval is kept as the
attempt's pending one (a later one replaces it) and written when the interval is up (a timer), or
before the attempt's outcome is committed (:func:`finish`), so the last report is never lost.
A report is checked at once (bad input raises in the body); a write that fails (the database
out) is logged and dropped: progress is never worth failing a body for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.protocol import FencingToken
from ..engine.facade import Orchestrator
from ..engine.worker_port import check_progress

log = logging.getLogger(__name__)


class Reporter:
    """One process's throttle: the last write and the pending report of each attempt. An
    attempt's writes are serialised (its own lock, held across the database write), so a timer's
    write never lands after a later report's, and :meth:`finish` waits for one in flight."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[FencingToken, float] = {}
        self._pending: dict[FencingToken, tuple[str, Any]] = {}
        self._timers: dict[FencingToken, threading.Timer] = {}
        self._writing: dict[FencingToken, threading.Lock] = {}
        #: writes made (the tests count them)
        self.writes = 0

    def report(self, orc: Orchestrator, token: FencingToken, state: str, meta: Any) -> None:
        """Record ``token``'s report now, or keep it pending until its interval is up."""
        check_progress(state, meta, orc.settings.max_progress_bytes)
        interval = orc.settings.progress_interval
        now = self.clock()
        with self._lock:
            writing = self._writing.setdefault(token, threading.Lock())
            last = self._last.get(token)
            due = last is None or now - last >= interval
            if due:
                self._last[token] = now
                self._pending.pop(token, None)
            else:
                self._pending[token] = (state, meta)
                if token not in self._timers:
                    timer = threading.Timer(max(interval - (now - (last or now)), 0.0), self._flush, (orc, token))
                    timer.daemon = True
                    self._timers[token] = timer
                    timer.start()
        if due:
            with writing:
                self._write(orc, token, state, meta)

    def finish(self, orc: Orchestrator, token: FencingToken) -> None:
        """The body ended: write its pending report (after a write in flight, before its
        outcome) and forget the attempt."""
        with self._lock:
            writing = self._writing.pop(token, None)
            timer = self._timers.pop(token, None)
        if timer is not None:
            timer.cancel()
        if writing is None:
            return
        with writing:  # a timer's or a report's write in flight ends first
            with self._lock:
                pending = self._pending.pop(token, None)
                self._last.pop(token, None)
            if pending is not None:
                self._write(orc, token, *pending)

    def _flush(self, orc: Orchestrator, token: FencingToken) -> None:
        with self._lock:
            self._timers.pop(token, None)
            writing = self._writing.get(token)
        if writing is None:  # finished meanwhile: finish() wrote what was pending
            return
        with writing:
            with self._lock:
                pending = self._pending.pop(token, None)
                if pending is None:
                    return
                self._last[token] = self.clock()
            self._write(orc, token, *pending)

    def _write(self, orc: Orchestrator, token: FencingToken, state: str, meta: Any) -> None:
        try:
            self.writes += 1
            if not orc.record_progress(token, state, meta):
                log.debug("progress of %s refused: the attempt no longer runs", token.task_id)
        except Exception:
            log.warning("progress of %s could not be recorded", token.task_id, exc_info=True)


#: the process's reporter
REPORTER = Reporter()


def reporter_for(orc: Orchestrator, token: FencingToken) -> Callable[[str, Any], None]:
    """What :class:`~orchestrator.runtime.context.TaskContext` calls to report ``token``'s progress."""

    def report(state: str, meta: Any) -> None:
        REPORTER.report(orc, token, state, meta)

    return report


def finish(orc: Orchestrator, token: FencingToken) -> None:
    """Write ``token``'s pending report before its outcome (never raises)."""
    try:
        REPORTER.finish(orc, token)
    except Exception:
        log.warning("the last progress of %s could not be recorded", token.task_id, exc_info=True)
