"""Operator actions on tasks and runs: retry, give up, skip, cancel.

An action that does not apply to the task or run as it is now (another writer got there
first, or it never applied) changes nothing: it writes a rejected event naming the actor and
returns ``accepted=False`` with the ``conflict``, which the engine raises as a
``ConflictError`` once the rejected event is committed. Only a retry that would orphan
decided children raises :class:`OperatorError` (nothing written).

Actions may be scoped to a tenant (:meth:`OperatorActions.scoped`, what an orchestrator bound
to a tenant acts through): each action's transaction first reads the run ``WHERE id = :run AND
tenant = :tenant``, so a run of another tenant is :class:`RunNotFound`, like a run that does not
exist, and nothing is written (not even a rejected event).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.errors import OperatorError, RunNotFound, TaskNotFound
from ..core.models import Actor, Outcome
from ..core.protocol import task_id
from ..core.states import NON_TERMINAL, RunState, TaskState
from . import schema as s
from . import stripes
from .admission import Admission
from .database import Database
from .dbtime import db_after, db_now
from .ledger import Ledger
from .settlement import Settlement

T = TaskState
t_tasks, t_runs = s.tasks, s.runs

#: the most open tasks one transaction of a cancel moves (:meth:`OperatorActions.cancel_run`)
CANCEL_BATCH = 500
#: a task not final yet (DEAD_LETTER and WAITING included): what a cancel moves
_OPEN = t_tasks.c.state.in_(sorted(st.value for st in NON_TERMINAL))


class Cancelled(NamedTuple):
    """What :meth:`OperatorActions.cancel_run` did."""

    #: the Celery task ids of the attempts it cancelled QUEUED or RUNNING, to revoke
    revoke: list[str]
    #: why the run could not be cancelled (it is SUCCEEDED or FAILED), or ``None``
    conflict: str | None
    #: the run was CANCELLED already (a repeated cancel: nothing, or the rest of an interrupted one, done)
    already: bool


class OperatorActions:
    def __init__(
        self, db: Database, ledger: Ledger, settlement: Settlement, admission: Admission, *, tenant: str | None = None
    ) -> None:
        self.db = db
        self.ledger = ledger
        self.settlement = settlement
        self.admission = admission
        #: the tenant whose runs these actions may touch (``None``: every tenant's)
        self.tenant = tenant

    def scoped(self, tenant: str | None) -> OperatorActions:
        """These actions as ``tenant`` may take them (``None``: on every tenant's runs)."""
        if tenant == self.tenant:
            return self
        return OperatorActions(self.db, self.ledger, self.settlement, self.admission, tenant=tenant)

    def _run_where(self, run_id: str) -> list[Any]:
        where = [t_runs.c.id == run_id]
        if self.tenant is not None:
            where.append(t_runs.c.tenant == self.tenant)
        return where

    def _gate(self, conn: Connection, run_id: str) -> None:
        """Raise :class:`RunNotFound` (before anything is written) unless the run exists and
        these actions may touch it."""
        if conn.execute(sa.select(t_runs.c.id).where(*self._run_where(run_id))).first() is None:
            raise RunNotFound(f"no run with id {run_id!r}")

    def retry_task(self, run_id: str, key: str, window: int, actor: Actor) -> Outcome:
        """DEAD_LETTER or FAILED -> READY with ``attempt + 1``.

        A FAILED task can be retried only while none of its children has been decided and
        its run is FAILED or RUNNING (a CANCELLED run stays cancelled): its children's
        counters are rolled back and a FAILED run is reopened. A child of a map is rolled back
        out of its map's counts too (a map closed FAILED reopens, MAPPED). A mapped node's key
        retries every FAILED or DEAD_LETTER child of it (the whole map). Raises
        :class:`OperatorError`.
        """

        def tx(conn: Connection) -> Outcome:
            self._gate(conn, run_id)
            task = self._task_row(conn, run_id, key)
            if task.map_spec is not None:
                return self._retry_map(conn, run_id, key, task, window, actor)
            return self._retry_one(conn, run_id, key, task, actor, window)

        return self.db.transaction(tx)

    def _retry_map(self, conn: Connection, run_id: str, key: str, task: Any, window: int, actor: Actor) -> Outcome:
        """Retry every FAILED or DEAD_LETTER child of the map ``key``."""
        failed = conn.execute(
            sa.select(t_tasks.c.key)
            .where(
                t_tasks.c.run_id == run_id,
                t_tasks.c.map_parent == key,
                t_tasks.c.state.in_([T.FAILED.value, T.DEAD_LETTER.value]),
            )
            .order_by(t_tasks.c.map_index)
        ).all()
        if not failed:
            why = (
                f"map {key!r} has no FAILED or DEAD_LETTER child to retry"
                if task.map_total
                else f"map {key!r} is {task.state} and has no children: it never expanded (see its error)"
            )
            return self._refuse(conn, run_id, key, task.attempt, T.READY, actor, why)
        dispatches: list[Any] = []
        for row in failed:
            out = self._retry_one(conn, run_id, row.key, self._task_row(conn, run_id, row.key), actor, 0)
            if not out.accepted:
                raise OperatorError(f"map {key!r}: child {row.key!r} could not be retried ({out.conflict})")
        dispatches = self.admission.admit(conn, window)
        return Outcome(True, T.READY, dispatches)

    def _retry_one(self, conn: Connection, run_id: str, key: str, task: Any, actor: Actor, window: int) -> Outcome:
        """One task's retry (``retry_task``); ``window`` 0: the caller admits."""
        src = TaskState(task.state)
        if src not in (T.DEAD_LETTER, T.FAILED):
            return self._refuse(
                conn, run_id, key, task.attempt, T.READY, actor,
                f"task {key!r} is {src.value}: only DEAD_LETTER or FAILED tasks can be retried",
            )  # fmt: skip
        values = {
            "attempt": task.attempt + 1, "ready_at": db_now(), "finished_at": None, "not_before": None,
            "fingerprint_streak": 0, "lease_losses": 0,
        }  # fmt: skip
        run_state: RunState | None = None
        children: list[str] = []
        if src is T.FAILED:
            # locked: the run cannot close or be cancelled under this retry
            run_state = RunState(
                conn.execute(sa.select(t_runs.c.state).where(t_runs.c.id == run_id).with_for_update()).scalar_one()
            )
            if run_state not in (RunState.RUNNING, RunState.FAILED):
                return self._refuse(
                    conn, run_id, key, task.attempt, T.READY, actor,
                    f"run {run_id} is {run_state.value}: its tasks cannot be retried",
                )  # fmt: skip
            children = self._undecided_children(conn, run_id, key, task.children or [])
        moved = self.ledger.move(
            conn, run_id, key, task.attempt, src, T.READY, actor, reason="manual retry", values=values
        )
        if not moved:
            return Outcome(False, None, [], moved.conflict)
        if src is T.FAILED:
            stripes.take_back(conn, run_id, task.stripe, list(task.children or []))
            if children:
                conn.execute(
                    t_tasks.update()
                    .where(t_tasks.c.run_id == run_id, t_tasks.c.key.in_(children))
                    .values(n_done=t_tasks.c.n_done - 1, n_failed=t_tasks.c.n_failed - 1)
                )
            reopened = 1 + self._uncount_from_map(conn, run_id, task, actor)
            conn.execute(t_runs.update().where(t_runs.c.id == run_id).values(open_tasks=t_runs.c.open_tasks + reopened))
            if run_state is RunState.FAILED:
                self.ledger.move_run(
                    conn, run_id, RunState.FAILED, RunState.RUNNING, actor,
                    reason=f"task {key} retried", values={"finished_at": None},
                )  # fmt: skip
        return Outcome(True, T.READY, self.admission.admit(conn, window) if window else [])

    def _uncount_from_map(self, conn: Connection, run_id: str, task: Any, actor: Actor) -> int:
        """A FAILED child of a map goes back to be run: out of its header's counts, and a
        header that had closed (FAILED) reopens (MAPPED). Returns how many tasks reopened (0 or 1)."""
        if task.map_parent is None:
            return 0
        header = conn.execute(
            t_tasks.update()
            .where(t_tasks.c.run_id == run_id, t_tasks.c.key == task.map_parent)
            .values(map_done=t_tasks.c.map_done - 1, map_failed=t_tasks.c.map_failed - 1)
            .returning(t_tasks.c.state, t_tasks.c.attempt)
        ).first()
        if header is None or header.state != T.FAILED.value:
            return 0
        moved = self.ledger.move(
            conn, run_id, task.map_parent, header.attempt, T.FAILED, T.MAPPED, actor,
            reason=f"child {task.key} retried", values={"finished_at": None},
        )  # fmt: skip
        return 1 if moved else 0

    def _undecided_children(self, conn: Connection, run_id: str, key: str, keys: list[str]) -> list[str]:
        """The task's children (``keys``: its row's ``children``, which a map's children have
        without edges), all still PENDING; raise :class:`OperatorError` otherwise."""
        children = conn.execute(
            sa.select(t_tasks.c.key, t_tasks.c.state).where(t_tasks.c.run_id == run_id, t_tasks.c.key.in_(keys))
        ).all()
        decided = [c.key for c in children if c.state != T.PENDING.value]
        if decided:
            raise OperatorError(
                f"task {key!r} has children already decided ({', '.join(decided[:5])}); retry it before"
                " its downstream is settled, or submit a new run"
            )
        return [c.key for c in children]

    def resolve_dead_letter(self, run_id: str, key: str, to: TaskState, window: int, actor: Actor) -> Outcome:
        """DEAD_LETTER -> FAILED or SKIPPED; descendants follow their trigger rules."""

        def tx(conn: Connection) -> Outcome:
            self._gate(conn, run_id)
            task = self._task_row(conn, run_id, key)
            if task.state != T.DEAD_LETTER.value:
                return self._refuse(
                    conn, run_id, key, task.attempt, to, actor,
                    f"task {key!r} is {task.state}: only a DEAD_LETTER task can be {to.value.lower()}",
                )  # fmt: skip
            reason = "operator gave up" if to is T.FAILED else "operator skipped it"
            moved = self.ledger.move(
                conn, run_id, key, task.attempt, T.DEAD_LETTER, to, actor,
                reason=reason, values={"finished_at": db_now()},
            )  # fmt: skip
            if not moved:
                return Outcome(False, None, [], moved.conflict)
            self.settlement.settle(conn, run_id, [(key, to, moved.row.children or [])], actor)
            return Outcome(True, to, self.admission.admit(conn, window))

        return self.db.transaction(tx)

    def clear_tasks(
        self,
        run_id: str,
        keys: list[str],
        actor: Actor,
        window: int,
        *,
        downstream: bool = False,
        upstream: bool = False,
        only_failed: bool = False,
        dry_run: bool = False,
        setup: bool = True,
    ) -> tuple[list[str], list[str], list[Any]]:
        """Send ``keys`` (with their descendants / ancestors in the run, and with ``setup`` the
        setups and teardowns of their scope: :func:`setup_scope`) back to be run again:
        ``orc_clear_v2``. Returns (the keys cleared, or that would be with ``dry_run``, in key
        order; the Celery task ids of the attempts it fenced, to revoke; the dispatches to
        publish). Raises :class:`TaskNotFound` for a key the run does not have,
        :class:`OperatorError` for a CANCELLED run or nothing to clear, :class:`RunNotFound`
        (nothing is written in any of these). A map's children are cleared with it; cleared with
        the task it maps over, it is expanded again when that task succeeds again."""

        def tx(conn: Connection) -> tuple[list[str], list[str], list[Any]]:
            run = conn.execute(sa.select(t_runs.c.state).where(*self._run_where(run_id)).with_for_update()).first()
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.state == RunState.CANCELLED.value:
                raise OperatorError(f"run {run_id} is CANCELLED: its tasks cannot be cleared (rerun it instead)")
            rows = {
                r.key: r
                for r in conn.execute(
                    sa.select(t_tasks.c.key, t_tasks.c.state, t_tasks.c.attempt, t_tasks.c.children,
                              t_tasks.c.map_spec.is_not(None).label("mapped"), t_tasks.c.map_parent, t_tasks.c.role)
                    .where(t_tasks.c.run_id == run_id)
                )
            }  # fmt: skip
            missing = sorted(set(keys) - set(rows))
            if missing:
                raise TaskNotFound(f"run {run_id!r} has no task {missing[0]!r}")
            chosen = set(keys)
            if downstream:
                chosen |= _reach(chosen, {k: list(r.children or []) for k, r in rows.items()})
            if upstream:
                parents: dict[str, list[str]] = {}
                for k, r in rows.items():
                    for child in r.children or []:
                        parents.setdefault(child, []).append(k)
                chosen |= _reach(chosen, parents)
            if setup:  # Airflow's: the setups a cleared task works under, and their teardowns
                chosen |= setup_scope(chosen, {k: list(r.children or []) for k, r in rows.items()},
                                      {k: r.role for k, r in rows.items() if r.role})  # fmt: skip
            # a map runs its children again (or, cleared with what it maps over, is expanded again)
            chosen |= {k for k, r in rows.items() if r.map_parent is not None and r.map_parent in chosen}
            if only_failed:
                chosen = {k for k in chosen if rows[k].state in (T.FAILED.value, T.UPSTREAM_FAILED.value)}
            if not chosen:
                raise OperatorError("nothing to clear: no task of those is FAILED or UPSTREAM_FAILED")
            cleared = sorted(chosen)
            if dry_run:
                return cleared, [], []
            fenced = [
                task_id(run_id, k, rows[k].attempt)
                for k in cleared
                if rows[k].state in (T.QUEUED.value, T.RUNNING.value)
            ]
            reason = (
                "cleared"
                + (" (with its downstream)" if downstream else "")
                + (" (with its upstream)" if upstream else "")
            )
            conn.execute(
                sa.text("SELECT orc_clear_v2(:run, :keys, :actor, :by, :reason)"),
                {"run": run_id, "keys": cleared, "actor": actor.role, "by": actor.by, "reason": reason},
            )
            return cleared, fenced, self.admission.admit(conn, window)

        return self.db.transaction(tx)

    def mark_task(
        self, run_id: str, key: str, to: TaskState, actor: Actor, window: int
    ) -> tuple[str, list[str], list[Any]]:
        """Set a task's outcome by hand (``orc_mark_v2``): SUCCEEDED, FAILED or SKIPPED; its
        children follow their trigger rules. Returns (the state it held, the Celery task id of a
        fenced attempt (or none), the dispatches). Raises as :meth:`clear_tasks`."""
        if to not in (T.SUCCEEDED, T.FAILED, T.SKIPPED):
            raise OperatorError(f"a task can be marked SUCCEEDED, FAILED or SKIPPED, not {to.value}")

        def tx(conn: Connection) -> tuple[str, list[str], list[Any]]:
            run = conn.execute(sa.select(t_runs.c.state).where(*self._run_where(run_id)).with_for_update()).first()
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.state == RunState.CANCELLED.value:
                raise OperatorError(f"run {run_id} is CANCELLED: its tasks cannot be marked")
            task = self._task_row(conn, run_id, key)
            if task.map_spec is not None:
                raise OperatorError(f"task {key!r} is a map: mark its children (its state follows theirs)")
            if task.state == to.value:
                raise OperatorError(f"task {key!r} is already {to.value}")
            fenced = [task_id(run_id, key, task.attempt)] if task.state in (T.QUEUED.value, T.RUNNING.value) else []
            held = conn.execute(
                sa.text("SELECT orc_mark_v2(:run, :key, :state, :actor, :by)"),
                {"run": run_id, "key": key, "state": to.value, "actor": actor.role, "by": actor.by},
            ).scalar_one()
            return str(held), fenced, self.admission.admit(conn, window)

        return self.db.transaction(tx)

    def cancel_run(self, run_id: str, actor: Actor) -> Cancelled:
        """The run RUNNING -> CANCELLED, then every non-terminal task -> CANCELLED.

        Returns the Celery task ids of the attempts that were QUEUED or RUNNING (to revoke)
        and no conflict. A run already CANCELLED is no conflict (``already``: a repeated cancel
        changes nothing, or finishes a cancel whose process died before its tasks were all
        cancelled). For a run final otherwise: ``[]`` and the conflict (a rejected run event is
        written). Raises :class:`RunNotFound`.

        The locks, and why they cannot deadlock with a completion. A completion (the hot path:
        ``orc_claim_v2``, ``orc_succeed_v2`` -> ``orc_follow_v1`` / ``orc_settle_v2``, a failure,
        a wait's wake) locks its own task row, then its children's rows and its map's header
        (a branch's skips already update the run's row on the way, so the run's row can come
        before more task rows), then the run's row, then the admission lock and READY rows
        with ``SKIP LOCKED``. No fixed order of task rows can agree with that, so the cancel
        takes no lock while it holds another that a completion may want:

        1. one transaction locks the run's row alone and moves it RUNNING -> CANCELLED (a
           completion holding the row is waited for; this transaction holds nothing it could
           want). From its commit the run cannot close, and a clear, a mark or a retry of a
           FAILED task is refused (each reads the run's state under the run's row lock);
        2. transactions of at most :data:`CANCEL_BATCH` open tasks each, in key order, lock
           them ``FOR UPDATE SKIP LOCKED``: they never wait for a row, so they cannot be in a
           cycle. Each task is a compare-and-set (its state and attempt as read under the lock)
           with its ledger row; a row a completion holds is skipped;
        3. when only rows held by others are left, one of them is waited for in a transaction
           that holds no other lock (a completion commits: the task is final, or still open and
           cancelled here), then step 2 again. New work a completion made meanwhile (children
           READY, a wide map's next window) is open, so it is found and cancelled: the loop
           ends when no task of the run is open;
        4. the run's ``open_tasks`` set to 0, in a transaction that locks only the run's row.

        Admission may move a READY task QUEUED until step 2 reaches it; that task is cancelled
        and revoked like any other, so nothing of the run is QUEUED or RUNNING once this returns.
        """
        already, conflict = self.db.transaction(lambda conn: self._cancel_run_row(conn, run_id, actor))
        if conflict is not None:
            return Cancelled([], conflict, False)
        live = self._sweep(run_id, actor)
        self.db.transaction(
            lambda conn: conn.execute(
                t_runs.update()
                .where(t_runs.c.id == run_id, t_runs.c.state == RunState.CANCELLED.value, t_runs.c.open_tasks != 0)
                .values(open_tasks=0)
            )
        )
        return Cancelled(live, None, already)

    def interrupted_cancels(self, grace_seconds: float = 30.0, limit: int = 10) -> list[str]:
        """Runs CANCELLED for over ``grace_seconds`` whose cancel did not finish (its process
        died between the run's CANCELLED and step 4 of :meth:`cancel_run`: ``open_tasks`` is
        set to 0 only once no task is open); the reconciler cancels them again."""
        r = t_runs.c
        return list(
            self.db.read(
                lambda conn: conn.execute(
                    sa.select(r.id)
                    .where(
                        r.state == RunState.CANCELLED.value,
                        r.open_tasks != 0,
                        r.finished_at < db_after(-float(grace_seconds)),
                    )
                    .order_by(r.finished_at)
                    .limit(limit)
                ).scalars()
            )
        )

    def _cancel_run_row(self, conn: Connection, run_id: str, actor: Actor) -> tuple[bool, str | None]:
        """Step 1 of :meth:`cancel_run`: (the run was CANCELLED already, the conflict)."""
        run = conn.execute(sa.select(t_runs.c.state).where(*self._run_where(run_id)).with_for_update()).first()
        if run is None:
            raise RunNotFound(f"no run with id {run_id!r}")
        if run.state == RunState.CANCELLED.value:
            return True, None
        if run.state != RunState.RUNNING.value:
            reason = "cancel refused: only a RUNNING run can be cancelled"
            self.ledger.move_run(conn, run_id, RunState.RUNNING, RunState.CANCELLED, actor, reason=reason)
            return False, f"run {run_id} is already {run.state}: only a RUNNING run can be cancelled"
        self.ledger.move_run(
            conn, run_id, RunState.RUNNING, RunState.CANCELLED, actor,
            reason="run cancelled", values={"finished_at": db_now()},
        )  # fmt: skip
        return False, None

    def _sweep(self, run_id: str, actor: Actor) -> list[str]:
        """Steps 2 and 3 of :meth:`cancel_run`: every open task of the (CANCELLED) run ->
        CANCELLED; returns the Celery task ids of those that were QUEUED or RUNNING."""
        live: list[str] = []
        c = t_tasks.c
        while True:
            after: str | None = ""
            while after is not None:
                q = (
                    sa.select(c.key, c.state, c.attempt)
                    .where(c.run_id == run_id, _OPEN, c.key > after)
                    .order_by(c.key)
                    .limit(CANCEL_BATCH)
                    .with_for_update(skip_locked=True)
                )
                moved, last, full = self.db.transaction(lambda conn: self._cancel_rows(conn, run_id, actor, q))  # noqa: B023
                live.extend(moved)
                after = last if full else None
            held = self.db.read(
                lambda conn: conn.execute(
                    sa.select(c.key).where(c.run_id == run_id, _OPEN).order_by(c.key).limit(1)
                ).scalar()
            )
            if held is None:
                return live
            # only rows another transaction holds (or made since) are left: wait for one,
            # holding no other lock, then look again
            one = sa.select(c.key, c.state, c.attempt).where(c.run_id == run_id, c.key == held, _OPEN).with_for_update()
            live.extend(self.db.transaction(lambda conn: self._cancel_rows(conn, run_id, actor, one))[0])  # noqa: B023

    def _cancel_rows(self, conn: Connection, run_id: str, actor: Actor, q: Any) -> tuple[list[str], str | None, bool]:
        """Lock the open tasks ``q`` selects (key, state, attempt) and move each -> CANCELLED
        (a compare-and-set on its state and attempt, with its ledger row). Returns (the Celery
        task ids of those that were QUEUED or RUNNING, the last key, whether a full batch)."""
        c = t_tasks.c
        rows = conn.execute(q).all()
        # one compare-and-set per (state, attempt) held: nearly always a few statements
        by_state: dict[tuple[str, int], list[Any]] = {}
        for r in rows:
            by_state.setdefault((r.state, r.attempt), []).append(r)
        live: list[str] = []
        for (src, attempt), group in sorted(by_state.items()):
            moved = self.ledger.move_many(
                conn,
                (c.run_id == run_id, c.key.in_([r.key for r in group]), c.attempt == attempt),
                TaskState(src),
                T.CANCELLED,
                actor,
                reason="run cancelled",
                values={"finished_at": db_now(), "lease_expires_at": None},
                expect=[(run_id, r.key, r.attempt) for r in group],
            )
            if src in (T.QUEUED.value, T.RUNNING.value):
                live.extend(task_id(run_id, m.key, m.attempt) for m in moved)
        return live, (rows[-1].key if rows else None), len(rows) >= CANCEL_BATCH

    def _refuse(
        self, conn: Connection, run_id: str, key: str, attempt: int, dst: TaskState, actor: Actor, why: str
    ) -> Outcome:
        """An action that does not apply to the task as it is now: a rejected event, no change."""
        self.ledger.reject(conn, run_id, key, attempt, dst, actor, why)
        return Outcome(False, None, [], why)

    def _task_row(self, conn: Connection, run_id: str, key: str) -> Any:
        row = conn.execute(
            sa.select(
                t_tasks.c.key,
                t_tasks.c.state,
                t_tasks.c.attempt,
                t_tasks.c.children,
                t_tasks.c.map_spec,
                t_tasks.c.map_parent,
                t_tasks.c.map_total,
                t_tasks.c.stripe,
            )
            .where(t_tasks.c.run_id == run_id, t_tasks.c.key == key)
            .with_for_update()
        ).first()
        if row is None:
            raise TaskNotFound(f"run {run_id!r} has no task {key!r}")
        return row


def _reach(start: set[str], links: dict[str, list[str]]) -> set[str]:
    """Every key reachable from ``start`` by ``links`` (children, or parents)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        for nxt in links.get(todo.pop(), []):
            if nxt not in seen and nxt not in start:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def setup_scope(keys: set[str], children: dict[str, list[str]], roles: dict[str, str]) -> set[str]:
    """The setups and teardowns a clear of ``keys`` takes along, as Airflow's clear does
    (``BaseOperator.get_upstreams_only_setups_and_teardowns``): for each key, every setup upstream
    of it that has a teardown downstream of the key, or has no teardown at all, and that setup's
    teardowns (its direct children that are teardowns), so the work runs again against a resource
    set up again and torn down after it; a setup key takes its own teardowns, and a setup or
    teardown key no setups above it (``DAG.partial_subset``). ``roles``: ``setup`` / ``teardown``."""
    parents: dict[str, list[str]] = {}
    for parent, kids in children.items():
        for kid in kids:
            parents.setdefault(kid, []).append(parent)
    found: set[str] = set()
    for key in keys:
        if roles.get(key) == "setup":  # partial_subset: a setup cleared takes its teardowns
            found.update(c for c in children.get(key, []) if roles.get(c) == "teardown")
        if key in roles:  # a setup or teardown takes no setups above it (partial_subset)
            continue
        below_teardowns = {k for k in _reach({key}, children) if roles.get(k) == "teardown"}
        for up in _reach({key}, parents):
            if roles.get(up) != "setup":
                continue
            teardowns = [c for c in children.get(up, []) if roles.get(c) == "teardown"]
            if not teardowns or below_teardowns & set(teardowns):
                found.add(up)
                found.update(t for t in teardowns if t != key)
    return found - keys
