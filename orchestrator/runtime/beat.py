"""A celery beat scheduler backed by the database's schedules (in the manner of
django-celery-beat and RedBeat).

``orchestrator beat`` uses it; with plain Celery::

    celery -A config.celery_app beat -S orchestrator.runtime.beat:DatabaseScheduler

Each beat pass runs :meth:`orchestrator.schedules.Schedules.tick`: the due schedules (judged by
the database clock) fire, each under its row lock, so any number of beats may run side by side
and an instant still fires once; then :meth:`orchestrator.services.triggers.Triggers.tick`: the event
triggers' firings left open (their emitter died before finishing them, or they wait for room
under ``max_active_runs``) start their runs, one per (trigger, event). Schedules and triggers
added, changed or paused through the CLI or the API are read on every pass, at most
``ORCHESTRATOR_BEAT_INTERVAL`` seconds apart: no restart. Entries of Celery's own
``beat_schedule`` are not used (the project's app has none).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.beat import Scheduler

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

log = logging.getLogger(__name__)


class DatabaseScheduler(Scheduler):  # type: ignore[misc]
    """Fires the schedules of ``orc_schedules``, and the event triggers' open firings, through
    the app's orchestrator."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._orc: Orchestrator | None = None
        super().__init__(*args, **kwargs)

    @property
    def orchestrator(self) -> Orchestrator:
        if self._orc is None:
            from .process import current_orchestrator

            self._orc = current_orchestrator(self.app)
        return self._orc

    def setup_schedule(self) -> None:
        """Nothing to read up front: every pass reads the schedules from the database."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One scheduler pass; returns the seconds to sleep before the next."""
        try:
            wait = float(self.orchestrator.schedules.tick())
            self.orchestrator.triggers.tick()
            return wait
        except Exception:
            # a pass must never end beat: log it and try again after the interval
            log.exception("scheduler pass failed")
            return float(self.orchestrator.settings.beat_interval) if self._orc is not None else 5.0

    @property
    def info(self) -> str:
        return "    . schedules: in the database (orchestrator schedule list)"
