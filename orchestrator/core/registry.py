"""The task-registry seam: which task names a DAG node may name, and which tasks want their
parents' results. Production asks the Celery app; unit tests use :class:`StaticRegistry`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Protocol

from .dag import UPSTREAM_KWARG

#: task-name prefixes that belong to Celery or to the orchestrator, never to a DAG node
RESERVED_PREFIXES = ("celery.", "orchestrator.")


class TaskRegistry(Protocol):
    def is_registered(self, name: str) -> bool:
        """True for a task that DAG nodes may name."""
        ...

    def wants_upstream(self, name: str) -> bool:
        """True when the task's function declares a parameter named ``upstream``."""
        ...


class CeleryRegistry:
    """The tasks registered on a Celery app (its task modules are imported on first use)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._loaded = False

    def _tasks(self) -> Any:
        if not self._loaded:
            self.app.loader.import_default_modules()
            self._loaded = True
        return self.app.tasks

    def is_registered(self, name: str) -> bool:
        return name in self._tasks() and not name.startswith(RESERVED_PREFIXES)

    def wants_upstream(self, name: str) -> bool:
        task = self._tasks().get(name)
        return task is not None and declares_upstream(task)


class StaticRegistry:
    """A fixed set of task names (tests); ``upstream`` lists those that want parents' results."""

    def __init__(self, names: Iterable[str], upstream: Iterable[str] = ()) -> None:
        self.names = frozenset(names)
        self.upstream = frozenset(upstream)

    def is_registered(self, name: str) -> bool:
        return name in self.names and not name.startswith(RESERVED_PREFIXES)

    def wants_upstream(self, name: str) -> bool:
        return name in self.upstream


def declares_upstream(task: Any) -> bool:
    """Whether a task's function declares a parameter named ``upstream``."""
    try:
        params = inspect.signature(task.run).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(UPSTREAM_KWARG)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
