"""Celery canvases as DAGs (pure: a signature is a ``dict`` underneath, read without Celery)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dag import DAG


def is_canvas(value: Any) -> bool:
    """Whether ``value`` looks like a Celery signature (a task's, a chain's, a group's or a chord's)."""
    return isinstance(value, Mapping) and "task" in value and "options" in value and "subtask_type" in value


def canvas_dag(canvas: Any, name: str | None = None) -> DAG:
    """The DAG ``canvas`` makes (being written)."""
    from .errors import ValidationError

    raise ValidationError("a Celery canvas cannot be submitted yet")
