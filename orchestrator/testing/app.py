"""The kit's side of Celery, in process: the settings of a kit's orchestrator, a Celery app of its
own whose tasks run on the production base class without a broker (:class:`KitTasks`), and the
publisher that hands each committed dispatch to the kit's worker (:class:`InProcessPublisher`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core.config import Settings
from ..core.models import Dispatch
from ..core.registry import RESERVED_PREFIXES, declares_upstream


class InProcessPublisher:
    """The broker of the kit: a FIFO queue the kit's worker takes messages from."""

    def __init__(self) -> None:
        self.queue: deque[Dispatch] = deque()
        #: every dispatch ever published, in order
        self.sent: list[Dispatch] = []
        self.revoked: set[str] = set()

    def publish(self, dispatches: Sequence[Dispatch]) -> int:
        self.queue.extend(dispatches)
        self.sent.extend(dispatches)
        return len(dispatches)

    def revoke(self, task_ids: Sequence[str]) -> None:
        self.revoked.update(task_ids)


log = logging.getLogger(__name__)

_kit_app: Any = None


def kit_app() -> Any:
    """A Celery app of the kit's own (no broker is ever used) for the stand-in tasks given as
    plain functions (``tasks={name: function}``)."""
    global _kit_app
    if _kit_app is None:
        from celery import Celery

        _kit_app = Celery(
            "orchestrator-testing", task_cls="orchestrator.runtime.worker:OrchestratedTask", set_as_current=False
        )
        _kit_app.conf.update(
            task_serializer="json", accept_content=["json"], task_ignore_result=True, result_serializer="json"
        )
    return _kit_app


class KitTasks:
    """The task registry of the kit: the stand-ins given to it (``tasks={name: task or
    function}``), then the tasks of the Celery app (by default the project's,
    :func:`orchestrator.runtime.celery_app.get_app`). Also the submit's registry check."""

    def __init__(self, app: Any = None) -> None:
        self._app = self._explicit = app
        self._loaded = False
        self.overrides: dict[str, Any] = {}

    @property
    def app(self) -> Any:
        if self._app is None:
            from ..runtime.celery_app import get_app

            self._app = get_app()
        return self._app

    def override(self, tasks: Mapping[str, Any] | None) -> None:
        for name, value in (tasks or {}).items():
            if hasattr(value, "run") and hasattr(value, "app"):
                self.overrides[name] = value  # a Celery task
            elif callable(value):
                app = kit_app()
                app.tasks.pop(name, None)
                self.overrides[name] = app.task(name=name, shared=False)(value)
            else:
                raise TypeError(f"tasks[{name!r}] must be a Celery task or a function, not {type(value).__name__}")

    def _tasks(self) -> Any:
        if not self._loaded:
            self._loaded = True
            try:
                self.app.loader.import_default_modules()
            except ImportError as exc:  # ORCHESTRATOR_TASK_MODULES names modules this project lacks
                log.debug("task modules not imported (%s); using the tasks registered so far", exc)
        return self.app.tasks

    def get(self, name: str) -> Any:
        found = self.overrides.get(name)
        if found is None:
            found = self._tasks().get(name)
        if found is None and self._explicit is None:
            found = _elsewhere(name)
        return found

    def is_registered(self, name: str) -> bool:
        return not name.startswith(RESERVED_PREFIXES) and self.get(name) is not None

    def wants_upstream(self, name: str) -> bool:
        task = self.get(name)
        return task is not None and declares_upstream(task)


def _elsewhere(name: str) -> Any:
    """An orchestrated task of that name on another Celery app of this process (a project that
    made its own with ``create_app``), when the default app has none."""
    from celery._state import _get_active_apps

    from ..runtime.worker import OrchestratedTask

    for app in list(_get_active_apps()):
        task = app.tasks.get(name)  # finalizes the app (its pending tasks registered), as a worker does
        if isinstance(task, OrchestratedTask):
            return task
    return None


def kit_settings(url: str, **overrides: Any) -> Settings:
    """The settings of a kit: the environment's (``ORCHESTRATOR_*``), on the kit's database,
    with no alert webhook and a reconciler that acts on its first look (it runs only when the
    kit says)."""
    base = Settings.from_env()
    return replace(
        base,
        database_url=url,
        tick_seconds=0.0,
        worker_reconciler=False,
        alert_webhook="",
        **overrides,
    )
