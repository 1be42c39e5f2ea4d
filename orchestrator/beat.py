"""The celery beat scheduler that fires the stored schedules (``celery beat -S
orchestrator.beat:DatabaseScheduler``; ``orchestrator beat`` passes it): a re-export of
:mod:`orchestrator.runtime.beat`."""

from .runtime.beat import DatabaseScheduler

__all__ = ["DatabaseScheduler"]
