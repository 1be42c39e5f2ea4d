"""Schedules: DAGs fired on a cron expression or an interval, kept in the database.

The calls of ``Orchestrator.schedules`` (:class:`~orchestrator.services.scheduling.Schedules`: add,
change, pause, resume, trigger, remove, backfill) as functions on :func:`orchestrator.default`,
and the names of :mod:`orchestrator.services.scheduling` (where schedules are implemented; see it for what
a schedule runs, when it fires and what ``orchestrator beat`` does).

This module imports the package root (for :func:`orchestrator.default`); nothing inside the
package imports it back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .core.cron import ScheduleError
from .services.schedule_model import Fired, Schedule, ScheduleNotFound
from .services.scheduling import CANCEL_PREVIOUS, PENDING_AFTER, Schedules
from .services.targets import (
    PLACEHOLDERS,
    FactoryNotAllowed,
    check_placeholders,
    dag_factory,
    load_factory,
    render,
    spec_hash,
)
from .store.schedules import iso

# ---------------------------------------------------------------------- the default orchestrator


def _default() -> Schedules:
    from . import default

    return default().schedules


def add(name: str, **kwargs: Any) -> Schedule:
    """:meth:`Schedules.add` on :func:`orchestrator.default`."""
    return _default().add(name, **kwargs)


def apply(path: str | Path) -> list[Schedule]:
    return _default().apply(path)


def get(name: str) -> Schedule:
    return _default().get(name)


def all_schedules() -> list[Schedule]:
    """Every schedule (of the default orchestrator's tenant, when it is bound to one)."""
    return _default().all()


def pause(name: str) -> Schedule:
    return _default().pause(name)


def resume(name: str) -> Schedule:
    return _default().resume(name)


def trigger(name: str) -> Fired:
    return _default().trigger(name)


def remove(name: str) -> None:
    _default().remove(name)


def backfill(name: str, start: dt.datetime, end: dt.datetime, **kwargs: Any) -> Iterator[Fired]:
    """A run for every instant of schedule ``name`` in ``[start, end)`` that has none
    (:meth:`Schedules.backfill`: ``max_active``, ``poll``, ``timeout``)."""
    return _default().backfill(name, start, end, **kwargs)


__all__ = [
    "CANCEL_PREVIOUS",
    "PENDING_AFTER",
    "PLACEHOLDERS",
    "FactoryNotAllowed",
    "Fired",
    "Schedule",
    "ScheduleError",
    "ScheduleNotFound",
    "Schedules",
    "add",
    "all_schedules",
    "apply",
    "backfill",
    "check_placeholders",
    "dag_factory",
    "get",
    "iso",
    "load_factory",
    "pause",
    "remove",
    "render",
    "resume",
    "spec_hash",
    "trigger",
]
