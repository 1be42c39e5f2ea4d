"""The one writer of state: every task and run state change, and its ledger row.

Each change is checked against the transition tables of ``states.py``, written as a
compare-and-set (``UPDATE ... WHERE state = :expected [AND attempt = :attempt]``) with its
event row in the same transaction, and carries the actor
(and the person, for operator actions) and the reason given by the caller. A compare-and-set
that loses its race writes a *rejected* event naming what the row holds now (the conflict
ledger) and reports the loss to the caller. No other module updates ``state``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.models import Actor
from ..core.states import RunState, TaskState, check_annotation, check_run_transition, check_transition
from . import schema as s
from .backend import EVENTS_AT_DB_NOW
from .database import Database

log = logging.getLogger(__name__)
t_tasks, t_runs = s.tasks, s.runs
#: the attempt recorded on a run's own events (runs have no attempts)
RUN_EVENT_ATTEMPT = 0


@dataclass(frozen=True)
class Moved:
    """The result of one task's compare-and-set: the moved row, or why it was refused."""

    row: Any = None
    conflict: str | None = None

    def __bool__(self) -> bool:
        return self.row is not None


def holds(run_id: str, key: str, state: TaskState, attempt: int) -> tuple[Any, ...]:
    """The fence of a single task's compare-and-set: the row holds ``state`` for ``attempt``.

    The state is compared as ``coalesce(state, '')``: a one-row fence must reach its row by the
    primary key, and a plan cached before the table had statistics may otherwise pick the state
    index, full of dead entries during a burst (the server functions of migration 0004 do the
    same)."""
    return (
        t_tasks.c.run_id == run_id,
        t_tasks.c.key == key,
        sa.func.coalesce(t_tasks.c.state, "") == state.value,
        t_tasks.c.attempt == attempt,
    )


class Ledger:
    """Writes task and run transitions with their events (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # ------------------------------------------------------------------ tasks

    def move(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        src: TaskState,
        dst: TaskState,
        actor: Actor,
        *,
        reason: str | None = None,
        values: dict[str, Any] | None = None,
        fence: Iterable[Any] = (),
        returning: Sequence[Any] = (),
    ) -> Moved:
        """Compare-and-set one task ``src`` -> ``dst`` while it holds ``attempt`` (and ``fence``).

        Returns the moved row with ``returning`` columns (``children`` by default), or a
        :class:`Moved` whose ``conflict`` says what the row holds, after a rejected event.
        The event records ``attempt`` even when ``values`` moves the row to a new one.
        """
        rows = self._update(
            conn,
            (*holds(run_id, key, src, attempt), *fence),
            src,
            dst,
            actor,
            reason,
            values or {},
            returning or (t_tasks.c.children,),
            event_attempt=attempt,
            state_fenced=True,
        )
        if rows:
            return Moved(rows[0])
        return Moved(None, self.reject(conn, run_id, key, attempt, dst, actor, reason))

    def move_many(
        self,
        conn: Connection,
        where: Iterable[Any],
        src: TaskState,
        dst: TaskState,
        actor: Actor,
        *,
        reason: str | None = None,
        values: dict[str, Any] | None = None,
        returning: Sequence[Any] = (),
        expect: Sequence[tuple[str, str, int]] = (),
    ) -> list[Any]:
        """Compare-and-set every task matching ``where`` that holds ``src``; one event each.

        Returns the moved rows (``run_id``, ``key``, ``attempt`` and ``returning``). Each of
        ``expect`` (run, key, attempt) that did not move gets a rejected event.
        """
        rows = self._update(conn, tuple(where), src, dst, actor, reason, values or {}, returning)
        if expect:
            moved = {(r.run_id, r.key) for r in rows}
            for run_id, key, attempt in expect:
                if (run_id, key) not in moved:
                    self.reject(conn, run_id, key, attempt, dst, actor, reason)
        return rows

    def _update(
        self,
        conn: Connection,
        where: tuple[Any, ...],
        src: TaskState,
        dst: TaskState,
        actor: Actor,
        reason: str | None,
        values: dict[str, Any],
        returning: Sequence[Any],
        event_attempt: int | None = None,
        state_fenced: bool = False,
    ) -> list[Any]:
        check_transition(src, dst, actor.role)
        # a bulk move selects by state (the state index serves it); a single move is fenced by
        # holds(), which compares the state already
        by_state = () if state_fenced else (t_tasks.c.state == src.value,)
        columns: dict[str, Any] = {c.name: c for c in (t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt)}
        for c in returning:
            columns.setdefault(c.name, c)
        update = (
            t_tasks.update().where(*by_state, *where).values(state=dst.value, **values).returning(*columns.values())
        )
        event = _event_constants(src.value, dst.value, actor, reason, True)
        if event_attempt is not None:
            event["attempt"] = event_attempt
        # two statements in the caller's transaction: a data-modifying CTE doing both in one
        # was measured slower on Postgres (building it costs more than the round trip it saves)
        rows = list(conn.execute(update).all())
        if rows:
            conn.execute(
                EVENTS_AT_DB_NOW,
                [{"run_id": r.run_id, "key": r.key, "attempt": r.attempt, **event} for r in rows],
            )
        return rows

    def reject(
        self,
        conn: Connection,
        run_id: str,
        key: str,
        attempt: int,
        dst: TaskState,
        actor: Actor,
        reason: str | None,
    ) -> str:
        """Write the rejected event of a task CAS that lost; return what the row holds now.

        Nothing is written for a task that does not exist: garbage must not grow the ledger.
        """
        row = conn.execute(
            sa.select(t_tasks.c.state, t_tasks.c.attempt).where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
        ).first()
        if row is None:
            log.info("refused %s %s.%s attempt %s -> %s: no such task", actor.role, run_id, key, attempt, dst.value)
            return "no such task"
        now_holds = f"row holds {row.state} attempt {row.attempt}"
        text = f"{reason + '; ' if reason else ''}{now_holds}"
        log.info("rejected %s %s.%s attempt %s -> %s: %s", actor.role, run_id, key, attempt, dst.value, text)
        conn.execute(
            EVENTS_AT_DB_NOW,
            {
                "run_id": run_id,
                "key": key,
                "attempt": attempt,
                **_event_constants(row.state, dst.value, actor, text, False),
            },
        )
        return now_holds

    def roots_ready(self, conn: Connection, run_id: str, keys: Sequence[str]) -> None:
        """The PENDING -> READY events of a new run's roots, inserted READY by submission."""
        check_transition(TaskState.PENDING, TaskState.READY, "submit")
        if keys:
            constants = _event_constants(TaskState.PENDING.value, TaskState.READY.value, Actor("submit"), "root", True)
            conn.execute(EVENTS_AT_DB_NOW, [{"run_id": run_id, "key": k, "attempt": 1, **constants} for k in keys])

    # ------------------------------------------------------------------ runs

    def create_run(self, conn: Connection, run_id: str, actor: Actor) -> None:
        """The run's first event (the row itself is inserted by submission)."""
        check_run_transition(None, RunState.RUNNING, actor.role)
        self._run_event(conn, run_id, None, RunState.RUNNING, actor, "submitted", True)

    def move_run(
        self,
        conn: Connection,
        run_id: str,
        src: RunState,
        dst: RunState,
        actor: Actor,
        *,
        reason: str | None = None,
        values: dict[str, Any] | None = None,
    ) -> bool:
        """Compare-and-set a run ``src`` -> ``dst`` with its event (``key`` null); a lost race
        writes a rejected event and returns ``False``."""
        check_run_transition(src, dst, actor.role)
        moved = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id, t_runs.c.state == src.value)
            .values(state=dst.value, **(values or {}))
            .returning(t_runs.c.id)
        ).first()
        if moved is not None:
            self._run_event(conn, run_id, src, dst, actor, reason, True)
            return True
        held = conn.execute(sa.select(t_runs.c.state).where(t_runs.c.id == run_id)).scalar_one_or_none()
        if held is not None:
            text = f"{reason + '; ' if reason else ''}run is {held}"
            self._run_event(conn, run_id, RunState(held), dst, actor, text, False)
        return False

    def annotate(
        self,
        conn: Connection,
        run_id: str,
        key: str | None,
        attempt: int,
        state: str,
        actor: Actor,
        kind: str,
        reason: str,
    ) -> None:
        """Record a fact about a task (``key``) or the run (``key`` None) that changes no state:
        an accepted event from ``state`` to ``state`` marked with ``kind`` (``states.ANNOTATIONS``)."""
        check_annotation(kind, actor.role)
        conn.execute(
            EVENTS_AT_DB_NOW,
            {
                "run_id": run_id,
                "key": key,
                "attempt": attempt,
                "kind": kind,
                **_event_constants(state, state, actor, reason, True),
            },
        )

    def _run_event(
        self,
        conn: Connection,
        run_id: str,
        src: RunState | None,
        dst: RunState,
        actor: Actor,
        reason: str | None,
        accepted: bool,
    ) -> None:
        conn.execute(
            EVENTS_AT_DB_NOW,
            {
                "run_id": run_id,
                "key": None,
                "attempt": RUN_EVENT_ATTEMPT,
                **_event_constants(src.value if src else None, dst.value, actor, reason, accepted),
            },
        )


def _event_constants(src: str | None, dst: str, actor: Actor, reason: str | None, accepted: bool) -> dict[str, Any]:
    return {
        "from_state": src,
        "to_state": dst,
        "actor": actor.role,
        "by": actor.by,
        "reason": reason,
        "accepted": accepted,
    }
