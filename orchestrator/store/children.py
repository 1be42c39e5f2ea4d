"""Child runs' rows (``DAG.run_dag``): which child-run nodes wait for a child to start, the link
between a parent node's attempt and its child (written in the child's submit transaction), the
parent node ended with its child, and the running children whose parent stopped waiting for them.

A child-run node is WAITING (``orc_wait_v1``, kind ``child``) from the moment its rule says READY.
The engine's child pass (``orchestrator.engine.children``) starts its child with the idempotency
key (parent run, key, attempt) and calls :meth:`ChildRows.link` in that submit's transaction: a
compare-and-set on the parent row (still WAITING at that attempt), so a child is stored only while
its node waits for it, and a duplicate start finds the child by its key instead of making one.
:meth:`ChildRows.complete` ends the node with its child's final state, fenced by state, attempt
and ``child_run_id``: a second completion of the same child loses its compare-and-set (a rejected
ledger row) and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.children import CHILD_TASK
from ..core.errors import OrchestratorError
from ..core.models import RECONCILER, Actor, Dispatch
from ..core.states import CHILD_RUN, RunState, TaskState
from . import schema as s
from .admission import Admission
from .database import Database
from .dbtime import db_now
from .ledger import Ledger
from .settlement import Settlement

T = TaskState
t_tasks, t_runs = s.tasks, s.runs


class ParentMoved(OrchestratorError):
    """The parent node no longer waits at the attempt a child was started for (cancelled,
    cleared, ended): the child's submit is rolled back."""


@dataclass(frozen=True)
class Pending:
    """A child-run node WAITING for its attempt's child to be started."""

    run_id: str
    key: str
    attempt: int
    tenant: str
    spec: dict[str, Any]


@dataclass(frozen=True)
class Done:
    """A child-run node WAITING on a child run that ended."""

    run_id: str
    key: str
    attempt: int
    max_attempts: int
    child_id: str
    child_state: str


def _waiting_children() -> tuple[Any, ...]:
    """The partial index ``ix_orc_tasks_child_waiting``'s predicate."""
    return (t_tasks.c.state == T.WAITING.value, t_tasks.c.task_name == CHILD_TASK)


class ChildRows:
    def __init__(self, db: Database, ledger: Ledger, settlement: Settlement, admission: Admission) -> None:
        self.db = db
        self.ledger = ledger
        self.settlement = settlement
        self.admission = admission

    def to_start(self, limit: int = 100) -> list[Pending]:
        """Child-run nodes WAITING whose attempt has no child yet (oldest first)."""
        c = t_runs.alias("c")
        started = sa.exists().where(c.c.id == t_tasks.c.child_run_id, c.c.parent_attempt == t_tasks.c.attempt)
        query = (
            sa.select(t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.tenant, t_tasks.c.wait_spec)
            .where(*_waiting_children(), ~started)
            .order_by(t_tasks.c.ready_at)
            .limit(limit)
        )
        rows = self.db.read(lambda conn: conn.execute(query).all())
        return [Pending(r.run_id, r.key, r.attempt, r.tenant, dict(r.wait_spec or {})) for r in rows]

    def link(self, conn: Connection, pending: Pending, child_id: str, wait: bool, what: str) -> list[Dispatch]:
        """In the child's submit transaction: the parent row (WAITING at that attempt) names its
        child, with a ``child_run`` ledger row; with ``wait=False`` the node SUCCEEDS at once
        (result ``{"run_id": ...}``) and is settled. Raises :class:`ParentMoved` (the caller's
        transaction, the child's insert with it, rolls back) when the row moved on."""
        moved = conn.execute(
            t_tasks.update()
            .where(
                t_tasks.c.run_id == pending.run_id,
                t_tasks.c.key == pending.key,
                t_tasks.c.state == T.WAITING.value,
                t_tasks.c.attempt == pending.attempt,
            )
            .values(child_run_id=child_id)
            .returning(t_tasks.c.key)
        ).first()
        if moved is None:  # the child's insert rolls back with this transaction: nothing is left of it
            raise ParentMoved(
                f"task {pending.key!r} of run {pending.run_id} no longer waits at attempt {pending.attempt}"
            )
        reason = f"started child run {child_id} ({what})"
        self.ledger.annotate(conn, pending.run_id, pending.key, pending.attempt, T.WAITING.value, RECONCILER, CHILD_RUN,
                             reason)  # fmt: skip
        # and on the child run's own ledger: whose child it is
        whose = f"child of run {pending.run_id} (task {pending.key}, attempt {pending.attempt})"
        self.ledger.annotate(conn, child_id, None, 0, RunState.RUNNING.value, RECONCILER, CHILD_RUN, whose)
        if wait:
            return []
        return self._end(conn, pending.run_id, pending.key, pending.attempt, child_id, T.SUCCEEDED,
                         {"result": {"run_id": child_id}}, f"child run {child_id} started (wait=False)")  # fmt: skip

    def finished(self, limit: int = 100) -> list[Done]:
        """Child-run nodes WAITING on a child run of their attempt that is final."""
        c = t_runs.alias("c")
        query = (
            sa.select(
                t_tasks.c.run_id,
                t_tasks.c.key,
                t_tasks.c.attempt,
                t_tasks.c.max_attempts,
                c.c.id.label("child_id"),
                c.c.state.label("child_state"),
            )
            .join(c, sa.and_(c.c.id == t_tasks.c.child_run_id, c.c.parent_attempt == t_tasks.c.attempt))
            .where(*_waiting_children(), c.c.state.in_([st.value for st in RunState if st.terminal]))
            .limit(limit)
        )
        rows = self.db.read(lambda conn: conn.execute(query).all())
        return [Done(r.run_id, r.key, r.attempt, r.max_attempts, r.child_id, r.child_state) for r in rows]

    def complete(self, done: Done, window: int) -> list[Dispatch]:
        """End the parent node with its child: SUCCEEDED with the child's leaf results by key;
        for a child FAILED or CANCELLED, the next attempt (a new child) while attempts are left,
        else FAILED. Fenced by state, attempt and child: a repeat is a rejected ledger row."""

        def tx(conn: Connection) -> list[Dispatch]:
            child = f"child run {done.child_id} {done.child_state}"
            if done.child_state == RunState.SUCCEEDED.value:
                result = leaf_results(conn, done.child_id)
                return self._end(conn, done.run_id, done.key, done.attempt, done.child_id, T.SUCCEEDED,
                                 {"result": result}, child, window)  # fmt: skip
            if done.attempt < done.max_attempts:
                self.ledger.move(
                    conn, done.run_id, done.key, done.attempt, T.WAITING, T.WAITING, RECONCILER,
                    reason=f"{child}; attempt {done.attempt + 1} starts a new child",
                    values={"attempt": done.attempt + 1, "child_run_id": None},
                    fence=(t_tasks.c.child_run_id == done.child_id,),
                )  # fmt: skip
                return []
            error = f"ChildRunFailed: {child}"
            return self._end(conn, done.run_id, done.key, done.attempt, done.child_id, T.FAILED, {"error": error},
                             child, window)  # fmt: skip

        return self.db.transaction(tx)

    def refuse(self, pending: Pending, problem: str, window: int) -> list[Dispatch]:
        """The node's child cannot be built (its registered DAG gone, a spec that no longer
        validates): the node FAILS with ``ChildRunRefused``, its downstream settled."""

        def tx(conn: Connection) -> list[Dispatch]:
            error = f"ChildRunRefused: {problem}"[:2000]
            return self._end(conn, pending.run_id, pending.key, pending.attempt, None, T.FAILED, {"error": error},
                             "its child run could not be started", window)  # fmt: skip

        return self.db.transaction(tx)

    def _end(
        self, conn: Connection, run_id: str, key: str, attempt: int, child_id: str | None, dst: TaskState,
        values: dict[str, Any], reason: str, window: int | None = None,
    ) -> list[Dispatch]:  # fmt: skip
        moved = self.ledger.move(
            conn, run_id, key, attempt, T.WAITING, dst, RECONCILER, reason=reason,
            values={**values, "finished_at": db_now()},
            fence=(t_tasks.c.child_run_id == child_id,) if child_id is not None else (),
        )  # fmt: skip
        if not moved:
            return []
        self.settlement.settle(conn, run_id, [(key, dst, list(moved.row.children or []))], RECONCILER)
        return self.admission.admit(conn, window) if window is not None else []

    def orphans(self, limit: int = 100) -> list[tuple[str, str, str]]:
        """Running child runs whose policy is ``cancel`` and whose parent node no longer waits
        for them: (child run, parent run, parent key). With ``wait=True``: the node left WAITING
        or moved to another attempt (cancelled, cleared, marked); with ``wait=False``: the
        parent run was cancelled or the node cleared."""
        c, p, pr = t_runs.alias("c"), t_tasks.alias("p"), t_runs.alias("pr")
        policy = sa.func.coalesce(p.c.wait_spec["on_parent_end"].as_string(), "cancel")
        waits = sa.func.coalesce(p.c.wait_spec["wait"].as_string(), "true") == "true"
        query = (
            sa.select(c.c.id, c.c.parent_run_id, c.c.parent_key)
            .join(p, sa.and_(p.c.run_id == c.c.parent_run_id, p.c.key == c.c.parent_key))
            .join(pr, pr.c.id == c.c.parent_run_id)
            .where(
                c.c.parent_run_id.is_not(None),
                c.c.state == RunState.RUNNING.value,
                policy == "cancel",
                sa.or_(
                    p.c.attempt != c.c.parent_attempt,
                    pr.c.state == RunState.CANCELLED.value,
                    p.c.state == T.CANCELLED.value,
                    sa.and_(waits, p.c.state != T.WAITING.value),
                ),
            )
            .limit(limit)
        )
        return [tuple(r) for r in self.db.read(lambda conn: conn.execute(query).all())]

    def note_cancel(self, child_id: str, parent_run: str, parent_key: str, actor: Actor = RECONCILER) -> None:
        """The ``child_run`` ledger row on the parent node: its child was cancelled by policy."""

        def tx(conn: Connection) -> None:
            row = conn.execute(
                sa.select(t_tasks.c.state, t_tasks.c.attempt).where(
                    t_tasks.c.run_id == parent_run, t_tasks.c.key == parent_key
                )
            ).first()
            if row is not None:
                self.ledger.annotate(conn, parent_run, parent_key, row.attempt, row.state, actor, CHILD_RUN,
                                     f"cancelled child run {child_id} (on_parent_end=cancel)")  # fmt: skip

        self.db.transaction(tx)

    def lineage(self, run_id: str) -> dict[str, Any]:
        """A run's parent (``{"run_id", "key", "attempt"}`` or None) and its child runs
        (``[{"run_id", "key", "attempt", "state", "dag_name"}]``, oldest first)."""

        def read(conn: Connection) -> dict[str, Any]:
            me = conn.execute(
                sa.select(t_runs.c.parent_run_id, t_runs.c.parent_key, t_runs.c.parent_attempt).where(
                    t_runs.c.id == run_id
                )
            ).first()
            kids = conn.execute(
                sa.select(t_runs.c.id, t_runs.c.parent_key, t_runs.c.parent_attempt, t_runs.c.state, t_runs.c.dag_name)
                .where(t_runs.c.parent_run_id == run_id)
                .order_by(t_runs.c.created_at)
            ).all()
            parent = None
            if me is not None and me.parent_run_id is not None:
                parent = {"run_id": me.parent_run_id, "key": me.parent_key, "attempt": me.parent_attempt}
            return {
                "parent": parent,
                "children": [
                    {
                        "run_id": k.id,
                        "key": k.parent_key,
                        "attempt": k.parent_attempt,
                        "state": k.state,
                        "dag_name": k.dag_name,
                    }
                    for k in kids
                ],
            }

        return self.db.read(read)


def leaf_results(conn: Connection, run_id: str) -> dict[str, Any]:
    """A child run's results as its parent node's result: its leaf tasks' results by key (a task
    with no child task; a map's children are counted in their map, whose result is theirs)."""
    leaf = sa.or_(t_tasks.c.children.is_(None), sa.cast(t_tasks.c.children, sa.Text).in_(["[]", "null"]))
    rows = conn.execute(
        sa.select(t_tasks.c.key, t_tasks.c.result)
        .where(t_tasks.c.run_id == run_id, t_tasks.c.map_parent.is_(None), leaf)
        .order_by(t_tasks.c.key)
    ).all()
    return {r.key: r.result for r in rows}
