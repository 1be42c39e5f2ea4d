"""A handle on one run (:class:`RunHandle`): what :meth:`Orchestrator.submit` and
:meth:`Orchestrator.run` return; each call goes through the orchestrator that made it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..core.errors import RunTimeout
from ..core.models import EventView, ProgressView, RunView, TaskView
from ..core.states import RunState, TaskState
from ..store.waits import Emitted

if TYPE_CHECKING:
    from .events import Events


class RunOwner(Protocol):
    """What a :class:`RunHandle` calls on the orchestrator that made it (an
    :class:`~orchestrator.engine.Orchestrator`)."""

    def visible(self, run_id: str) -> RunView: ...
    def run_state(self, run_id: str) -> RunState: ...
    def tasks(self, run_id: str) -> list[TaskView]: ...
    def progress(self, run_id: str) -> dict[str, ProgressView]: ...
    def task(self, run_id: str, key: str) -> TaskView: ...
    def ledger(self, run_id: str, *, newest: int | None = None) -> list[EventView]: ...
    def cancel(self, run_id: str, *, by: str | None = None) -> int: ...
    def retry_task(self, run_id: str, key: str, *, by: str | None = None) -> None: ...
    def skip_task(self, run_id: str, key: str, *, by: str | None = None) -> None: ...
    def fail_task(self, run_id: str, key: str, *, by: str | None = None) -> None: ...
    def clear(
        self, run_id: str, *keys: str, downstream: bool = False, upstream: bool = False, only_failed: bool = False,
        dry_run: bool = False, by: str | None = None, setup: bool = True,
    ) -> list[str]: ...  # fmt: skip
    def mark(self, run_id: str, key: str, state: TaskState | str, *, by: str | None = None) -> TaskState: ...
    def rerun(self, run_id: str) -> RunHandle: ...
    def approve(self, run_id: str, key: str, *, by: str | None = None, comment: str | None = None) -> None: ...
    def reject(self, run_id: str, key: str, *, by: str | None = None, comment: str | None = None) -> None: ...
    def is_transient(self, exc: BaseException) -> bool: ...

    @property
    def events(self) -> Events: ...


log = logging.getLogger(__name__)


class RunHandle:
    """A submitted run: ``id``, ``status()``, ``tasks()``, ``wait()``, ``results()``;
    ``warnings``: what :meth:`DAG.lint` found when it was submitted (likely mistakes that are
    still valid, such as a join below a branch that keeps ``all_success``)."""

    def __init__(self, orchestrator: RunOwner, run_id: str, *, warnings: list[str] | None = None) -> None:
        self.orchestrator = orchestrator
        self.id = run_id
        self.warnings: list[str] = list(warnings or [])

    def __repr__(self) -> str:
        return f"<RunHandle {self.id}>"

    def status(self) -> RunView:
        return self.orchestrator.visible(self.id)

    @property
    def state(self) -> RunState:
        return self.orchestrator.run_state(self.id)

    def tasks(self) -> list[TaskView]:
        return self.orchestrator.tasks(self.id)

    def task(self, key: str) -> TaskView:
        return self.orchestrator.task(self.id, key)

    def events(self) -> list[EventView]:
        return self.orchestrator.ledger(self.id)

    def cancel(self, *, by: str | None = None) -> int:
        return self.orchestrator.cancel(self.id, by=by)

    def retry(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.retry_task(self.id, key, by=by)

    def skip(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.skip_task(self.id, key, by=by)

    def clear(
        self,
        *keys: str,
        downstream: bool = False,
        upstream: bool = False,
        only_failed: bool = False,
        by: str | None = None,
        setup: bool = True,
    ) -> list[str]:
        """:meth:`Orchestrator.clear` on this run."""
        return self.orchestrator.clear(
            self.id, *keys, downstream=downstream, upstream=upstream, only_failed=only_failed, by=by, setup=setup
        )

    def mark(self, key: str, state: TaskState | str, *, by: str | None = None) -> TaskState:
        """:meth:`Orchestrator.mark` on this run."""
        return self.orchestrator.mark(self.id, key, state, by=by)

    def rerun(self) -> RunHandle:
        """:meth:`Orchestrator.rerun` of this run."""
        return self.orchestrator.rerun(self.id)

    def fail(self, key: str, *, by: str | None = None) -> None:
        self.orchestrator.fail_task(self.id, key, by=by)

    def signal(self, name: str, payload: dict[str, Any] | None = None, *, event_id: str | None = None) -> Emitted:
        """Send the signal ``name`` to this run (see :meth:`orchestrator.engine.events.Events.signal`)."""
        return self.orchestrator.events.signal(self.id, name, payload, event_id=event_id)

    def approve(self, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Approve this run's approval node ``key`` (see :meth:`Orchestrator.approve`)."""
        self.orchestrator.approve(self.id, key, by=by, comment=comment)

    def reject(self, key: str, *, by: str | None = None, comment: str | None = None) -> None:
        """Reject this run's approval node ``key`` (see :meth:`Orchestrator.reject`)."""
        self.orchestrator.reject(self.id, key, by=by, comment=comment)

    def progress(self) -> dict[str, ProgressView]:
        """The latest progress each task's current attempt reported with ``update_state`` (or
        ``current_context().progress``), by key: ``state``, ``meta``, ``attempt``, ``updated_at``."""
        return self.orchestrator.progress(self.id)

    def results(self) -> dict[str, Any]:
        """The stored JSON result of every task that succeeded, by node key."""
        return {t.key: t.result for t in self.tasks() if t.state.value == "SUCCEEDED"}

    def wait(self, timeout: float | None = None, *, poll: float = 0.1) -> RunView:
        """Block until the run is final; raise :class:`RunTimeout` after ``timeout`` seconds.
        A database outage (a lost or refused connection) is waited out, logged, until then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.state.terminal:  # one row by primary key per poll; the counts once, at the end
                    return self.status()
            except Exception as exc:
                if not self.orchestrator.is_transient(exc):
                    raise
                log.warning("waiting for run %s: the database is unreachable (%s); still waiting", self.id, exc)
            if deadline is not None and time.monotonic() >= deadline:
                raise RunTimeout(f"run {self.id} still running after {timeout}s")
            time.sleep(poll)
