"""The project's Celery app (``get_app()``, and ``celery -A config.celery_app``): a re-export of
:mod:`orchestrator.runtime.celery_app`."""

from .runtime.celery_app import (
    VISIBILITY_MARGIN,
    check_worker_settings,
    create_app,
    get_app,
)

__all__ = [
    "VISIBILITY_MARGIN",
    "check_worker_settings",
    "create_app",
    "get_app",
]
