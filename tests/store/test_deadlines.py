"""Deadlines on SQLite and Postgres alike: a miss is recorded once (a compare-and-set with its
ledger event), alerted once however many passes and reconcilers look, and with
``on_deadline="cancel"`` the run is cancelled as the reconciler; a run done in time has none."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, Settings, TaskState
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.routing import default_queues, route
from orchestrator.core.states import DEADLINE_MISSED
from orchestrator.services import alerts
from orchestrator.services.invariants import check_runs
from orchestrator.services.reconciler import Reconciler
from orchestrator.store import Store
from orchestrator.store import schema as s
from orchestrator.store.dbtime import db_now
from orchestrator.store.deadlines import iso_utc

T = TaskState
#: a logical date whose deadlines are long past
PAST = "2020-01-01T00:00:00Z"


@pytest.fixture
def url(pg_clean: str) -> str:
    return pg_clean


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    st = Store(url, dispatch_depth=1)
    st.workers.register("test-worker", default_queues(), 10_000)
    yield st
    st.dispose()


@pytest.fixture
def alerted() -> Iterator[list[dict[str, Any]]]:
    """The payloads of every ``deadline_missed`` signal sent while the test runs."""
    received: list[dict[str, Any]] = []
    lock = threading.Lock()

    def receiver(sender: Any = None, alert: dict[str, Any] | None = None, **_: Any) -> None:
        assert sender == "reconciler" and alert is not None
        with lock:
            received.append(alert)

    alerts.deadline_missed.connect(receiver, weak=False)
    try:
        yield received
    finally:
        alerts.deadline_missed.disconnect(receiver)


def reconciler(store: Store) -> Reconciler:
    return Reconciler(store, RecordingPublisher(), Settings.from_env({}, dispatch_timeout=60.0))


def submit(store: Store, dag: DAG, *, logical_date: str | None = None) -> str:
    dag.validate()
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.submission.create_run(
        dag, queues=queues, wants_upstream=lambda name: False, logical_date=logical_date
    )
    return run_id


def run_task(store: Store, run_id: str, key: str) -> None:
    store.admission.admit_ready(10_000)
    task = store.reads.get_task(run_id, key)
    assert task.state is T.QUEUED, (key, task.state)
    assert store.attempts.claim(run_id, key, task.attempt, "w1", 30, "t") is not None
    assert store.attempts.succeed(run_id, key, task.attempt, None, 10_000).accepted


def misses(store: Store, run_id: str) -> list[Any]:
    """The run's ``deadline_missed`` ledger rows (accepted or not)."""
    return [e for e in store.reads.snapshot([run_id]).events if e.kind == DEADLINE_MISSED]


def columns(store: Store, table: sa.Table, *where: Any) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(
            sa.select(table.c.deadline_at, table.c.deadline_checked_at, table.c.deadline_missed_at).where(*where)
        ).one()


def test_a_missed_run_deadline_is_recorded_once_and_alerted_once(store: Store, alerted: list[dict[str, Any]]) -> None:
    # Given a run of a DAG with a 600 s deadline whose logical date is years ago
    dag = DAG("late", tenant="acme", deadline=600)
    dag.task("load", "t")
    run_id = submit(store, dag, logical_date=PAST)

    # When the reconciler passes several times
    r = reconciler(store)
    reports = [r.run_pass() for _ in range(3)]

    # Then the miss is one ledger row, one verdict and one alert; the run goes on
    assert [rep["deadlines_missed"] for rep in reports] == [1, 0, 0]
    assert all(rep["errors"] == 0 for rep in reports)
    [event] = misses(store, run_id)
    assert (event.key, event.attempt, event.from_state, event.to_state) == (None, 0, "RUNNING", "RUNNING")
    assert (event.actor, event.accepted) == ("reconciler", True)
    assert event.reason == "deadline missed: run deadline 600s (due 2020-01-01T00:10:00Z)"
    _, checked, missed = columns(store, s.runs, s.runs.c.id == run_id)
    assert checked is not None and missed is not None
    assert store.reads.get_run(run_id).state is RunState.RUNNING
    assert [a["run_id"] for a in alerted] == [run_id]
    assert alerted[0] == {
        "event": "deadline_missed",
        "run_id": run_id,
        "dag": "late",
        "tenant": "acme",
        "key": None,
        "deadline_seconds": 600.0,
        "due_at": "2020-01-01T00:10:00Z",
        "missed_at": alerted[0]["missed_at"],
        "state": "RUNNING",
        "on_deadline": "alert",
        "reason": "deadline missed: run deadline 600s (due 2020-01-01T00:10:00Z)",
    }
    # the read side: the misses and their count (what the metrics count)
    [miss] = store.deadlines.misses(run_id)
    assert (miss.key, miss.deadline_seconds, miss.state) == (None, 600.0, "RUNNING")
    assert (miss.dag, miss.tenant, miss.due_at.isoformat()) == ("late", "acme", "2020-01-01T00:10:00+00:00")
    assert store.deadlines.count() == {"run": 1, "task": 0}
    # the run still finishes, and the ledger keeps every invariant (the annotation is legal)
    run_task(store, run_id, "load")
    assert store.reads.get_run(run_id).state is RunState.SUCCEEDED
    reconciler(store).run_pass()
    assert len(misses(store, run_id)) == 1 and len(alerted) == 1
    assert check_runs(store, [run_id]) == []


def test_a_node_deadline_is_judged_per_task(store: Store, alerted: list[dict[str, Any]]) -> None:
    # Given a run whose logical date was 10 minutes ago, and a DAG whose node "load" must be
    # done 5 minutes after it, and "extract" a day after it (not due yet)
    logical = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=10)
    dag = DAG("etl")
    extract = dag.task("extract", "t", deadline=86400)
    dag.task("load", "t", upstream=[extract], deadline=300)
    dag.task("report", "t", upstream=[extract])
    run_id = submit(store, dag, logical_date=logical.isoformat())

    r = reconciler(store)
    assert r.run_pass()["deadlines_missed"] == 1
    assert r.run_pass()["deadlines_missed"] == 0

    [event] = misses(store, run_id)
    due = iso_utc(logical + dt.timedelta(minutes=5))
    assert (event.key, event.attempt, event.from_state, event.to_state) == ("load", 1, "PENDING", "PENDING")
    assert event.reason == f"deadline missed: task 'load' deadline 300s (due {due})"
    assert [(a["key"], a["deadline_seconds"], a["due_at"]) for a in alerted] == [("load", 300.0, due)]
    assert store.deadlines.count() == {"run": 0, "task": 1}
    # the run has no deadline of its own, and "extract"'s is not due
    assert columns(store, s.runs, s.runs.c.id == run_id) == (None, None, None)
    due_at, checked, _ = columns(store, s.tasks, s.tasks.c.run_id == run_id, s.tasks.c.key == "extract")
    assert due_at is not None and checked is None
    assert store.reads.get_run(run_id).state is RunState.RUNNING


def test_on_deadline_cancel_cancels_the_run_and_its_tasks(store: Store, alerted: list[dict[str, Any]]) -> None:
    # Given a running run of a DAG with on_deadline="cancel" whose deadline passed
    dag = DAG("strict", deadline=60, on_deadline="cancel")
    a = dag.task("a", "t")
    dag.task("b", "t", upstream=[a])
    dag.task("c", "t")
    run_id = submit(store, dag, logical_date=PAST)
    run_task(store, run_id, "c")
    store.admission.admit_ready(10_000)
    assert store.attempts.claim(run_id, "a", 1, "w1", 30, "t") is not None  # "a" is RUNNING

    # When the reconciler passes
    publisher = RecordingPublisher()
    r = Reconciler(store, publisher, Settings.from_env({}, dispatch_timeout=60.0))
    report = r.run_pass()

    # Then the run and its open tasks are CANCELLED by the reconciler, the running attempt is
    # revoked, and the miss is recorded once, after the cancel
    assert (report["deadline_cancels"], report["deadlines_missed"], report["errors"]) == (1, 1, 0)
    assert store.reads.get_run(run_id).state is RunState.CANCELLED
    states = {t.key: t.state for t in store.reads.get_tasks(run_id)}
    assert states == {"a": T.CANCELLED, "b": T.CANCELLED, "c": T.SUCCEEDED}
    assert publisher.revoked == [f"{run_id}.a.1"]
    events = store.reads.events(run_id)
    run_events = [(e.from_state, e.to_state, e.actor, e.accepted) for e in events if e.key is None]
    assert run_events == [
        (None, "RUNNING", "submit", True),
        ("RUNNING", "CANCELLED", "reconciler", True),
        ("CANCELLED", "CANCELLED", "reconciler", True),  # the miss
    ]
    assert sorted((e.key, e.from_state, e.actor) for e in events if e.to_state == "CANCELLED" and e.key) == [
        ("a", "RUNNING", "reconciler"),
        ("b", "PENDING", "reconciler"),
    ]
    [event] = misses(store, run_id)
    assert event.reason == (
        "deadline missed: run deadline 60s (due 2020-01-01T00:01:00Z); it was RUNNING;"
        " on_deadline=cancel: the run is CANCELLED"
    )
    assert [(x["state"], x["on_deadline"]) for x in alerted] == [("CANCELLED", "cancel")]
    # a late result of the revoked attempt is rejected; nothing more happens on later passes
    assert not store.attempts.succeed(run_id, "a", 1, "late", 10_000).accepted
    again = r.run_pass()
    assert (again["deadline_cancels"], again["deadlines_missed"]) == (0, 0)
    assert check_runs(store, [run_id]) == []


def test_a_task_deadline_with_cancel_cancels_the_run(store: Store) -> None:
    logical = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    dag = DAG("strict-task", on_deadline="cancel")
    dag.task("slow", "t", deadline=60)
    dag.task("later", "t", deadline=86400)
    run_id = submit(store, dag, logical_date=logical.isoformat())
    report = reconciler(store).run_pass()
    assert (report["deadline_cancels"], report["deadlines_missed"]) == (1, 1)
    assert store.reads.get_run(run_id).state is RunState.CANCELLED
    [event] = misses(store, run_id)
    assert (event.key, event.to_state) == ("slow", "CANCELLED")
    # the pass admitted it before judging deadlines (admission first: a slow alert never delays it)
    assert "it was QUEUED" in event.reason and "the run is CANCELLED" in event.reason
    # "later" was cancelled long before its deadline: when that falls due it is met, not missed
    assert columns(store, s.tasks, s.tasks.c.run_id == run_id, s.tasks.c.key == "later")[2] is None
    assert check_runs(store, [run_id]) == []


def test_a_run_that_ends_late_between_passes_still_missed(store: Store, alerted: list[dict[str, Any]]) -> None:
    # Given a run with a 0.3 s deadline that ends after it, while no reconciler looked
    dag = DAG("slow", deadline=0.3)
    dag.task("a", "t")
    run_id = submit(store, dag)
    time.sleep(0.5)
    run_task(store, run_id, "a")

    # When a reconciler passes afterwards
    assert reconciler(store).run_pass()["deadlines_missed"] == 1

    # Then the miss is recorded against the finished run (the stored finish is after the due time)
    [event] = misses(store, run_id)
    assert (event.from_state, event.to_state) == ("SUCCEEDED", "SUCCEEDED")
    assert event.reason.startswith("deadline missed: run deadline 0.3s (due ")
    assert [a["state"] for a in alerted] == ["SUCCEEDED"]
    assert check_runs(store, [run_id]) == []


def test_two_reconcilers_record_a_miss_once(url: str, store: Store, alerted: list[dict[str, Any]]) -> None:
    # Given runs that missed their deadlines (one with on_deadline="cancel"), and a second store
    # (its own engine and connections: another process, as far as the database can tell)
    ids = []
    for i in range(6):
        dag = DAG(f"late{i}", deadline=10, on_deadline="cancel" if i == 0 else "alert")
        dag.task("a", "t", deadline=5)
        dag.task("b", "t", upstream=["a"])
        ids.append(submit(store, dag, logical_date=PAST))
    other = Store(url, dispatch_depth=1)
    try:
        reconcilers = [reconciler(store), reconciler(other)]
        barrier = threading.Barrier(2)
        reports: list[dict[str, int]] = []

        def go(r: Reconciler) -> None:
            barrier.wait()
            for _ in range(3):
                reports.append(r.run_pass())

        # When both pass at the same time, three times each
        threads = [threading.Thread(target=go, args=(r,)) for r in reconcilers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        other.dispose()

    # Then each miss (a run's and a task's per run) is one ledger row and one alert
    assert sum(r["errors"] for r in reports) == 0
    assert sum(r["deadlines_missed"] for r in reports) == 12
    assert sum(r["deadline_cancels"] for r in reports) == 1
    for run_id in ids:
        assert sorted((e.key or "") for e in misses(store, run_id)) == ["", "a"]
    assert sorted((a["run_id"], a["key"] or "") for a in alerted) == sorted(
        [(run_id, "") for run_id in ids] + [(run_id, "a") for run_id in ids]
    )
    assert store.deadlines.count() == {"run": 6, "task": 6}
    assert store.reads.get_run(ids[0]).state is RunState.CANCELLED
    ledger = store.reads.snapshot(ids[:1]).events
    cancels = [e for e in ledger if e.key is None and e.to_state == "CANCELLED" and e.kind is None]
    assert [e.accepted for e in cancels if e.accepted] == [True]  # one accepted cancel (a loser is rejected)
    assert check_runs(store, ids[1:], in_progress_ok=True) == []
    assert check_runs(store, ids[:1]) == []


def test_the_checker_refuses_a_forged_or_repeated_annotation(store: Store) -> None:
    dag = DAG("forged", deadline=10)
    dag.task("a", "t")
    run_id = submit(store, dag, logical_date=PAST)
    reconciler(store).run_pass()
    with store.engine.begin() as conn:
        row = {"run_id": run_id, "attempt": 0, "by": None, "accepted": True, "kind": DEADLINE_MISSED}
        conn.execute(
            s.events.insert().values(at=db_now()),
            [
                {**row, "key": None, "from_state": "RUNNING", "to_state": "RUNNING", "actor": "reconciler",
                 "reason": "deadline missed: again"},
                {**row, "key": "a", "from_state": "QUEUED", "to_state": "RUNNING", "actor": "operator",
                 "reason": "forged"},
                {**row, "key": "a", "from_state": "QUEUED", "to_state": "QUEUED", "actor": "reconciler",
                 "reason": "x", "kind": "made_up"},
            ],
        )  # fmt: skip
    problems = check_runs(store, [run_id], in_progress_ok=True)
    assert sorted(problems) == sorted(
        [
            f"run {run_id}: deadline_missed recorded 2 times",
            f"{run_id}.a: deadline_missed recorded by operator",
            f"{run_id}.a: deadline_missed annotation changed the state QUEUED -> RUNNING",
            f"{run_id}.a: unknown ledger annotation 'made_up'",
        ]
    )


def test_a_deadline_past_the_year_9999_is_refused_before_anything_is_written(store: Store) -> None:
    from orchestrator.core.errors import ValidationError

    dag = DAG("far", deadline=366 * 86400)
    dag.task("a", "t")
    with pytest.raises(ValidationError, match="past the year 9999"):
        submit(store, dag, logical_date="9999-12-31")
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one() == 0


def test_racing_records_of_the_same_misses_record_each_once(url: str, store: Store) -> None:
    # Given 20 missed run deadlines, found by two reconcilers' queries before either records
    ids = []
    for i in range(20):
        dag = DAG(f"race{i}", deadline=1)
        dag.task("a", "t")
        ids.append(submit(store, dag, logical_date=PAST))
    other = Store(url, dispatch_depth=1)
    try:
        found = [store.deadlines.due(), other.deadlines.due()]
        assert [len(f) for f in found] == [20, 20]
        barrier = threading.Barrier(2)
        recorded: list[list[Any]] = [[], []]

        def go(i: int, st: Store) -> None:
            barrier.wait()
            for item in found[i]:
                miss = st.deadlines.record(item)
                if miss is not None:
                    recorded[i].append(miss)

        # When both record every one of them at the same time
        threads = [threading.Thread(target=go, args=(i, st)) for i, st in enumerate((store, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        other.dispose()

    # Then every miss was recorded by exactly one of them, with exactly one event
    assert sorted(m.run_id for m in recorded[0] + recorded[1]) == sorted(ids)
    assert all(len(misses(store, run_id)) == 1 for run_id in ids)
    assert store.deadlines.due() == []
