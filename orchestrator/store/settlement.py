"""Settlement: a task became terminal, so count it into its children, decide their trigger
rules, cascade SKIPPED / UPSTREAM_FAILED, and close the run when nothing is left open.

Readiness is decided from per-task counters (``UPDATE ... SET n_done = n_done + 1 ...
RETURNING``), never by scanning the run, in the server function ``orc_settle_v2``. The actor
that caused the first change is the actor of every change it cascades into.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.models import Actor
from ..core.states import TERMINAL, RunState, TaskState, run_outcome
from . import schema as s
from .database import Database
from .dbtime import db_now
from .ledger import Ledger

T = TaskState
t_tasks, t_runs = s.tasks, s.runs


_ORC_SETTLE = sa.text("SELECT orc_settle_v2(:run, :key, :state, CAST(:children AS json), :actor, :by)")

#: one terminal task to settle: (key, state it ended in, its child keys)
Finished = tuple[str, TaskState, list[str]]


class Settlement:
    def __init__(self, db: Database, ledger: Ledger) -> None:
        self.db = db
        self.ledger = ledger

    def settle(self, conn: Connection, run_id: str, finished: list[Finished], actor: Actor) -> None:
        """Count the newly terminal tasks into their children, cascade what that decides, and
        close the run when no task is open: the server function ``orc_settle_v2``
        (``store/sql/settle.sql``), one round trip per finished task."""
        for key, state, children in finished:
            conn.execute(
                _ORC_SETTLE,
                {"run": run_id, "key": key, "state": state.value, "children": json.dumps(children),
                 "actor": actor.role, "by": actor.by},
            )  # fmt: skip

    def close_tasks(self, conn: Connection, run_id: str, closed: int, actor: Actor, *, recount: bool = False) -> None:
        """Subtract ``closed`` from the run's open-task count (or recount it from the task
        rows); at zero, move the run RUNNING -> SUCCEEDED / FAILED (FAILED when a task that
        decides the run ended FAILED or UPSTREAM_FAILED, as ``orc_settle_v2`` judges it)."""
        if recount:
            new_value: Any = (
                sa.select(sa.func.count())
                .where(t_tasks.c.run_id == run_id, t_tasks.c.state.not_in([st.value for st in TERMINAL]))
                .scalar_subquery()
            )
        else:
            new_value = t_runs.c.open_tasks - closed
        row = conn.execute(
            t_runs.update()
            .where(t_runs.c.id == run_id)
            .values(open_tasks=new_value)
            .returning(t_runs.c.open_tasks, t_runs.c.state)
        ).first()
        if row is None or row.open_tasks > 0 or row.state != RunState.RUNNING.value:
            return
        failed = conn.execute(
            sa.select(sa.func.count()).where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.state.in_([T.FAILED.value, T.UPSTREAM_FAILED.value]),
                t_tasks.c.decides_run,
            )
        ).scalar_one()
        outcome = run_outcome(failed)
        reason = f"{failed} task(s) failed" if failed else "every task succeeded or was skipped"
        self.ledger.move_run(
            conn, run_id, RunState.RUNNING, outcome, actor, reason=reason, values={"finished_at": db_now()}
        )
