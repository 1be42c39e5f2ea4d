"""Cancelling a busy run (issue 36, crossing 3): the cancel never waits for a task row while it
holds another lock, so it cannot deadlock with the completions that keep coming while it runs
(a completion locks its task, its children and its map's header, then the run's row).

Every test here fails on the cancel that locked the run's row and then every open task in key
order: a completion holding its task and waiting for the run's row closed the cycle, Postgres
reported ``deadlock detected`` and the cancel's transaction was retried (or failed)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, Settings, TaskState
from orchestrator.core.models import operator
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.routing import default_queues, route
from orchestrator.core.states import TERMINAL
from orchestrator.services.invariants import check_runs
from orchestrator.services.reconciler import Reconciler
from orchestrator.store import Store
from orchestrator.store import schema as s

T = TaskState
OP = operator("alice")
#: a logical date whose deadlines are long past
PAST = "2020-01-01T00:00:00Z"


#: the fake worker group's slots: the in-flight window a busy run keeps full
SLOTS = 200


@pytest.fixture
def store(pg_clean: str) -> Iterator[Store]:
    st = Store(pg_clean, dispatch_depth=1)
    st.workers.register("test-worker", default_queues(), SLOTS)
    yield st
    st.dispose()


def submit(store: Store, dag: DAG, *, logical_date: str | None = None) -> str:
    dag.validate()
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.submission.create_run(
        dag, queues=queues, wants_upstream=lambda name: False, logical_date=logical_date
    )
    return run_id


def wide_run(store: Store, n: int, **dag_options: Any) -> tuple[str, list[str]]:
    """A run of ``ls -> m (n children) -> join`` whose ``ls`` succeeded: the first children
    QUEUED (the worker group's :data:`SLOTS`), the rest READY. Returns the run and the keys
    of the QUEUED children."""
    dag = DAG(f"wide-{n}", **dag_options)
    ls = dag.task("ls", "t")
    m = dag.map("m", "t", over=ls, kwarg="x", max_map_length=100_000)
    dag.task("join", "t", upstream=[m])
    run_id = submit(store, dag, logical_date=PAST if "deadline" in dag_options else None)
    store.admission.admit_ready(10_000)
    assert store.attempts.claim(run_id, "ls", 1, "w1", 30, "t") is not None
    out = store.attempts.succeed(run_id, "ls", 1, list(range(n)), 10_000)
    assert out.accepted
    return run_id, [d.key for d in out.dispatches]


class Completions:
    """Threads playing a busy worker group on the store's hot path: each takes the next
    dispatched child, claims it and succeeds it (``orc_claim_v2``, ``orc_succeed_v2``, which
    dispatches the next READY child into the slot), until nothing is left to take or, once
    the cancel returned, ``after`` more calls each were made."""

    def __init__(self, store: Store, run_id: str, keys: list[str], threads: int = 6, after: int = 20) -> None:
        self.store, self.run_id, self.after = store, run_id, after
        self.todo: queue.Queue[str] = queue.Queue()
        for key in keys:
            self.todo.put(key)
        self.lock = threading.Lock()
        self.done = 0
        self.errors: list[BaseException] = []
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.threads = [threading.Thread(target=self._loop) for _ in range(threads)]

    def _loop(self) -> None:
        late = 0
        try:
            while late < self.after:
                try:
                    key = self.todo.get(timeout=2)
                except queue.Empty:
                    return
                if self.cancelled.is_set():
                    late += 1
                if self.store.attempts.claim(self.run_id, key, 1, "w1", 30, "t") is not None:
                    out = self.store.attempts.succeed(self.run_id, key, 1, key, 10_000)
                    for d in out.dispatches:
                        self.todo.put(d.key)
                with self.lock:
                    self.done += 1
                    if self.done >= 50:
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
            self.started.set()

    def __enter__(self) -> Completions:
        for t in self.threads:
            t.start()
        assert self.started.wait(60), "the completions did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancelled.set()
        for t in self.threads:
            t.join(60)


def deadlocks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The retries after a deadlock that the store logged (the cancel's transaction, or a
    hot-path call, rolled back by Postgres's deadlock check)."""
    return [r.getMessage() for r in caplog.records if "Deadlock" in r.getMessage()]


def check_cancelled(store: Store, run_id: str, mark: int) -> None:
    """Every task terminal, none moved after its CANCELLED, nothing of the run accepted after
    ``mark`` (the ledger's last id when the cancel returned), the ledger consistent."""
    tasks = store.reads.get_tasks(run_id)
    assert {t.state for t in tasks} <= set(TERMINAL)
    assert store.reads.get_run(run_id).state is RunState.CANCELLED
    events = store.reads.snapshot([run_id]).events
    cancelled_at: dict[str, int] = {}
    for e in sorted(events, key=lambda ev: ev.id):
        if e.key is None or not e.accepted or e.kind is not None:
            continue
        assert e.key not in cancelled_at, f"{e.key}: {e.from_state} -> {e.to_state} after its CANCELLED"
        if e.to_state == "CANCELLED":
            cancelled_at[e.key] = e.id
    assert {t.key for t in tasks if t.state is T.CANCELLED} == set(cancelled_at)
    late = [(e.key, e.from_state, e.to_state) for e in events if e.id > mark and e.accepted]
    assert late == [], late  # nothing of the run dispatched (or anything else) after the cancel returned
    with store.engine.connect() as conn:
        open_tasks = conn.execute(sa.select(s.runs.c.open_tasks).where(s.runs.c.id == run_id)).scalar_one()
    assert open_tasks == 0
    assert check_runs(store, [run_id]) == []


def last_event(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.max(s.events.c.id))).scalar_one())


def test_a_cancel_and_a_completion_waiting_for_the_run_row_do_not_deadlock(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The cycle, step by step: a completion has moved its task (and holds its row and its map
    header's) and is about to count it into the run's row when the cancel starts."""
    caplog.set_level(logging.WARNING)
    run_id, _ = wide_run(store, 20)
    assert store.attempts.claim(run_id, "m[3]", 1, "w1", 30, "t") is not None
    completion = store.engine.connect()
    tx = completion.begin()
    # orc_succeed_v2's first steps: the task's compare-and-set, then (settle) its map's header
    completion.execute(
        sa.text("UPDATE orc_tasks SET state = 'SUCCEEDED' WHERE run_id = :r AND key = 'm[3]' AND state = 'RUNNING'"),
        {"r": run_id},
    )
    completion.execute(
        sa.text("UPDATE orc_tasks SET map_done = map_done + 1, map_ok = map_ok + 1 WHERE run_id = :r AND key = 'm'"),
        {"r": run_id},
    )
    out: dict[str, Any] = {}

    def cancel() -> None:
        try:
            out["done"] = store.operator.cancel_run(run_id, OP)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            out["error"] = exc

    pid = completion.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    thread = threading.Thread(target=cancel)
    thread.start()
    try:
        # the cancel waits for one of the completion's task rows (the old order: holding the
        # run's row; now: holding nothing, the run already CANCELLED and the rest cancelled)
        with store.engine.connect() as conn:
            waiting = sa.text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY (pg_blocking_pids(pid))")
            while thread.is_alive() and not conn.execute(waiting, {"pid": pid}).scalar_one():
                conn.rollback()
                time.sleep(0.01)
        # the completion counts its task into the run's row (settle's last step), then ends
        completion.execute(sa.text("UPDATE orc_runs SET open_tasks = open_tasks - 1 WHERE id = :r"), {"r": run_id})
        tx.rollback()
    finally:
        completion.close()
        thread.join(60)
    assert "error" not in out, out.get("error")
    assert deadlocks(caplog) == []
    assert out["done"].conflict is None
    assert {t.key: t.state for t in store.reads.get_tasks(run_id) if t.state is not T.CANCELLED} == {"ls": T.SUCCEEDED}
    assert check_runs(store, [run_id]) == []


def test_a_busy_wide_run_is_cancelled_at_the_first_try(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    # Given a map of 3,000 children, 200 QUEUED, and six threads claiming and succeeding them
    caplog.set_level(logging.WARNING)
    run_id, keys = wide_run(store, 3000)
    with Completions(store, run_id, keys) as busy:
        # When the run is cancelled while they run
        cancelled = store.operator.cancel_run(run_id, OP)
        mark = last_event(store)
    # Then the cancel succeeded at its first try (no deadlock, nothing retried), the tasks in
    # flight are to be revoked, every task is terminal and none moved after its CANCELLED
    assert busy.errors == []
    assert deadlocks(caplog) == []
    assert cancelled.conflict is None and not cancelled.already
    assert busy.done >= 50
    live = {t.key for t in store.reads.get_tasks(run_id) if t.state is T.CANCELLED}
    assert {x.rsplit(".", 1)[0].split(".", 1)[1] for x in cancelled.revoke} <= live
    check_cancelled(store, run_id, mark)
    assert sum(1 for t in store.reads.get_tasks(run_id) if t.state is T.SUCCEEDED) >= 50


def test_a_cancel_is_idempotent_and_finishes_an_interrupted_one(store: Store) -> None:
    # Given a run whose cancel stopped after the run was marked CANCELLED (its process died)
    run_id, _ = wide_run(store, 30)
    assert store.attempts.claim(run_id, "m[0]", 1, "w1", 30, "t") is not None
    ops = store.operator

    def no_sweep(*args: Any) -> list[str]:
        raise RuntimeError("the process died")

    ops._sweep = no_sweep  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        ops.cancel_run(run_id, OP)
    del ops._sweep
    assert store.reads.get_run(run_id).state is RunState.CANCELLED
    assert T.QUEUED in {t.state for t in store.reads.get_tasks(run_id)}

    # When it is cancelled again, and once more
    again = ops.cancel_run(run_id, OP)
    third = ops.cancel_run(run_id, OP)

    # Then the second cancel finished the first (the attempt in flight to revoke) and the third
    # changed nothing; neither is a conflict, and the run was cancelled once in the ledger
    assert again.conflict is None and again.already
    assert f"{run_id}.m[0].1" in again.revoke and len(again.revoke) == 30
    assert (third.revoke, third.conflict, third.already) == ([], None, True)
    run_events = [(e.from_state, e.to_state, e.accepted) for e in store.reads.events(run_id) if e.key is None]
    assert run_events[1:] == [("RUNNING", "CANCELLED", True)]
    check_cancelled(store, run_id, last_event(store))


def test_on_deadline_cancel_of_a_busy_run_takes_the_same_path(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    # Given a busy wide run whose DAG says on_deadline="cancel" and whose deadline passed
    caplog.set_level(logging.WARNING)
    run_id, keys = wide_run(store, 2000, deadline=60, on_deadline="cancel")
    reconciler = Reconciler(store, RecordingPublisher(), Settings.from_env({}, dispatch_timeout=60.0))
    with Completions(store, run_id, keys):
        # When the reconciler passes while the completions go on
        report = reconciler.run_pass()
        mark = last_event(store)
    # Then it cancelled the run at the first try, revoked what was in flight, recorded the miss
    assert deadlocks(caplog) == []
    assert (report["deadline_cancels"], report["errors"]) == (1, 0)
    assert reconciler.publisher.revoked  # type: ignore[attr-defined]
    check_cancelled(store, run_id, mark)


def test_the_reconciler_finishes_a_cancel_whose_process_died(store: Store) -> None:
    # Given a run whose cancel stopped after the run was marked CANCELLED, a minute ago
    run_id, _ = wide_run(store, 30)
    assert store.attempts.claim(run_id, "m[0]", 1, "w1", 30, "t") is not None
    ops = store.operator

    def no_sweep(*args: Any) -> list[str]:
        raise RuntimeError("the process died")

    ops._sweep = no_sweep  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        ops.cancel_run(run_id, OP)
    del ops._sweep
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE orc_runs SET finished_at = now() - interval '1 minute' WHERE id = :r"), {"r": run_id}
        )
    assert ops.interrupted_cancels() == [run_id]

    # When the reconciler passes
    reconciler = Reconciler(store, RecordingPublisher(), Settings.from_env({}, dispatch_timeout=60.0))
    assert reconciler.run_pass()["errors"] == 0

    # Then it cancelled the open tasks as the reconciler and revoked the one in flight
    assert f"{run_id}.m[0].1" in reconciler.publisher.revoked  # type: ignore[attr-defined]
    actors = {e.actor for e in store.reads.events(run_id) if e.key is not None and e.to_state == "CANCELLED"}
    assert actors == {"reconciler"}
    assert ops.interrupted_cancels() == []
    check_cancelled(store, run_id, last_event(store))
