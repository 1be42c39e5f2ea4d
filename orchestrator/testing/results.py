"""What :func:`run_dag` returns: a :class:`RunResult` (the run's final state, every task's result,
state and attempts, its ledger with virtual times) and the :class:`Delivery` of each message the
in-process publisher carried."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.models import EventView, TaskView
from ..core.states import RunState, TaskState
from ..engine.facade import Orchestrator, RunHandle
from .inputs import (
    Input,
)


class Driver(Protocol):
    """What a :class:`RunResult` uses of the :class:`~orchestrator.testing.Kit` that made it."""

    orc: Orchestrator

    def drive(
        self,
        run: Any,
        *,
        events: Iterable[Input] = (),
        auto_advance: bool = True,
        started_at: dt.datetime | None = None,
    ) -> RunResult: ...


@dataclass(frozen=True)
class Delivery:
    """One message the kit's worker took: ``outcome`` is ``ran`` (the body ran, through the
    worker's code), ``failed`` (a :class:`FailTimes` stood in for the body), ``lost``
    (:class:`LoseDispatch`), ``crashed`` (:class:`CrashWorker`) or ``revoked``."""

    run_id: str
    key: str
    attempt: int
    task: str
    outcome: str


def _run_id(run: Any) -> str:
    if isinstance(run, str):
        return run
    if isinstance(run, (RunResult, RunHandle)):
        return run.id if isinstance(run, RunHandle) else run.run_id
    raise TypeError(f"give a run (RunResult, RunHandle or run id), not {type(run).__name__}")


@dataclass
class RunResult:
    """What a run came to (a snapshot, taken when the drive stopped).

    ``state`` is the run's :class:`~orchestrator.RunState` (``"SUCCEEDED"``, ``"FAILED"``, or
    ``"RUNNING"`` when it still waits for something no input and no instant brings), ``states``
    ``{key: TaskState}``, ``results`` the stored JSON result of every task that succeeded,
    ``attempts`` ``{key: attempt}``, ``ledger`` the run's events (``run.events()``),
    ``deliveries`` the messages the kit's worker took for it. ``explain(key)`` says why a task
    is where it is (``orchestrator explain``); ``resume()`` goes on driving."""

    run_id: str
    state: RunState
    tasks: list[TaskView]
    ledger: list[EventView]
    deliveries: list[Delivery]
    started_at: dt.datetime
    now: dt.datetime
    kit: Driver = field(repr=False)

    @property
    def states(self) -> dict[str, TaskState]:
        return {t.key: t.state for t in self.tasks}

    @property
    def results(self) -> dict[str, Any]:
        return {t.key: t.result for t in self.tasks if t.state is TaskState.SUCCEEDED}

    @property
    def attempts(self) -> dict[str, int]:
        return {t.key: t.attempt for t in self.tasks}

    @property
    def errors(self) -> dict[str, str]:
        return {t.key: t.error for t in self.tasks if t.error}

    @property
    def elapsed(self) -> dt.timedelta:
        """Virtual time from the submit to the snapshot."""
        return self.now - self.started_at

    @property
    def handle(self) -> RunHandle:
        return self.kit.orc.run(self.run_id)

    def task(self, key: str) -> TaskView:
        for t in self.tasks:
            if t.key == key:
                return t
        raise KeyError(f"run {self.run_id} has no task {key!r}; it has {sorted(self.states)}")

    def explain(self, key: str | None = None) -> str:
        """Why ``key`` (every task when ``None``) is in its state, one line per task."""
        lines = []
        for e in self.kit.orc.explain(self.run_id, key):
            lines.append(f"{e.key} {e.state.value}: " + "; ".join(r.detail for r in e.reasons))
        return "\n".join(lines)

    def resume(self, *, events: Iterable[Input] = (), auto_advance: bool = True) -> RunResult:
        """Drive the run on (after the test emitted, approved or moved the clock itself)."""
        return self.kit.drive(self.run_id, events=events, auto_advance=auto_advance, started_at=self.started_at)

    def assert_succeeded(self) -> None:
        """Raise :class:`AssertionError` with every unsuccessful task explained unless the run succeeded."""
        if self.state is not RunState.SUCCEEDED:
            bad = [k for k, st in self.states.items() if st is not TaskState.SUCCEEDED]
            detail = "\n".join(self.explain(k) for k in bad)
            raise AssertionError(f"run {self.run_id} is {self.state.value}:\n{detail}")

    def __repr__(self) -> str:
        return f"<RunResult {self.run_id} {self.state.value} {dict(self.states)}>"
