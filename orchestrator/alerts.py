"""The alerts' Celery signals (``orchestrator.alerts.task_dead_lettered.connect(...)``, as the
guide shows): a re-export of :mod:`orchestrator.services.alerts`."""

from .services.alerts import breaker_changed, deadline_missed, schedule_failed, task_dead_lettered, task_stuck

__all__ = ["breaker_changed", "deadline_missed", "schedule_failed", "task_dead_lettered", "task_stuck"]
