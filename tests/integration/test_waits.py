"""Waits and events end to end: a real prefork worker (``-c 2``, its reconciler in its main
process) runs the tasks while the test emits events, approves, and lets sleeps and sensors
come due. Each scenario ends SUCCEEDED with the payload where it belongs, and the database's
invariants (``orc.verify``) report nothing."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, RunState, TaskState
from tests.integration.conftest import WorkerProcess

T = TaskState
pytestmark = pytest.mark.integration
P = "tasks.probes."
D = "tasks.dynamic."


def unique(prefix: str) -> str:
    """An event key of this test alone (the session's database keeps other tests' events)."""
    return f"{prefix}.{uuid.uuid4().hex[:10]}"


def until_state(run: Any, key: str, state: TaskState, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        task = run.task(key)
        if task.state is state:
            return task
        if time.monotonic() >= deadline:
            pytest.fail(f"{key} is {task.state.value} (attempt {task.attempt}), not {state.value}, after {timeout}s")
        time.sleep(0.05)


def ledger(run: Any, key: str) -> list[tuple[str | None, str, int, bool]]:
    return [(e.from_state, e.to_state, e.attempt, e.accepted) for e in run.events() if e.key == key]


def claims(run: Any, key: str) -> int:
    """Accepted claims (-> RUNNING) of ``key``: its executions."""
    return sum(1 for e in run.events() if e.key == key and e.accepted and e.to_state == "RUNNING")


def assert_verified(orc: Orchestrator, *run_ids: str) -> None:
    problems = orc.verify(list(run_ids))
    assert problems == [], problems


def test_an_emitted_event_wakes_a_waiting_run(orc: Orchestrator, worker: WorkerProcess) -> None:
    key = unique("order.paid")
    dag = DAG("it-event-wait")
    dag.task("a", P + "noop")
    dag.wait("paid", event=key, match={"order_id": 42}, upstream=["a"], timeout=120)
    dag.task("b", P + "echo", upstream=["paid"])
    run = orc.submit(dag)
    waiting = until_state(run, "paid", T.WAITING)
    assert waiting.worker is None and run.task("b").state is T.PENDING
    assert orc.events.emit(key, {"order_id": 41}).woken == 0  # no match: still waiting
    time.sleep(0.5)
    assert run.task("paid").state is T.WAITING and run.state is RunState.RUNNING

    done = orc.events.emit(key, {"order_id": 42, "amount": 9.5}, event_id=f"{key}-1")
    assert done.woken == 1
    assert run.wait(timeout=30).state is RunState.SUCCEEDED
    assert run.task("paid").result == {"order_id": 42, "amount": 9.5}
    assert run.task("b").result == {"kwargs": {}, "upstream": {"paid": {"order_id": 42, "amount": 9.5}}}
    # the same event again is de-duplicated and wakes nothing (another payload: EventIdConflict)
    assert orc.events.emit(key, {"order_id": 42, "amount": 9.5}, event_id=f"{key}-1").duplicate
    assert ledger(run, "paid") == [("PENDING", "WAITING", 1, True), ("WAITING", "SUCCEEDED", 1, True)]
    assert_verified(orc, run.id)


def test_a_sleep_is_woken_by_the_workers_reconciler(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("it-sleep")
    dag.task("a", P + "noop")
    dag.wait("nap", delay=2, upstream=["a"])
    dag.task("b", P + "echo", upstream=["nap"])
    run = orc.submit(dag)
    until_state(run, "nap", T.WAITING)
    assert run.wait(timeout=120).state is RunState.SUCCEEDED
    # nothing in the test woke it: the reconciler in the worker's main process did, once due (by
    # the ledger's times: not before the 2 s were up)
    nap = run.task("nap")
    assert nap.result is None and run.task("b").result == {"kwargs": {}, "upstream": {"nap": None}}
    woke = [e for e in run.events() if e.key == "nap" and e.to_state == "SUCCEEDED" and e.accepted]
    assert len(woke) == 1 and woke[0].actor == "reconciler", woke
    (began,) = [e for e in run.events() if e.key == "nap" and e.to_state == "WAITING" and e.accepted]
    assert woke[0].at is not None and began.at is not None
    slept = (woke[0].at - began.at).total_seconds()
    assert slept >= 2.0, slept
    assert_verified(orc, run.id)


def test_a_sensor_waits_as_a_row_between_checks_and_holds_no_slot(orc: Orchestrator, worker: WorkerProcess) -> None:
    # Given a sensor whose check says "not yet" twice, checking every 2.5 s
    dag = DAG("it-sensor")
    dag.sensor("file", P + "not_yet", kwargs={"times": 2}, every=2.5, timeout=120)
    dag.task("after", P + "echo", upstream=["file"])
    run = orc.submit(dag)
    first = until_state(run, "file", T.WAITING)
    assert first.worker is None

    # When, while it waits, another DAG runs two 1.5 s tasks on the worker's two slots
    busy = DAG("it-sensor-neighbour")
    busy.task("x", P + "sleep", kwargs={"seconds": 1.5})
    busy.task("y", P + "sleep", kwargs={"seconds": 1.5})
    other = orc.submit(busy)
    assert other.wait(timeout=30).state is RunState.SUCCEEDED

    # Then both ran at once (the waiting sensor held neither slot)
    spans = {}
    for e in other.events():
        if e.key and e.accepted and e.to_state == "RUNNING":
            spans[e.key] = [e.at, None]
    for e in other.events():
        if e.key and e.accepted and e.to_state == "SUCCEEDED":
            spans[e.key][1] = e.at
    (x0, x1), (y0, y1) = spans["x"], spans["y"]
    assert x0 < y1 and y0 < x1, spans  # overlapping: both slots were free

    # And the sensor succeeds on its third check with its count, its check run three times
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    sensor = run.task("file")
    assert sensor.result == {"checks": 2}
    assert run.task("after").result == {"kwargs": {}, "upstream": {"file": {"checks": 2}}}
    assert claims(run, "file") == 3
    waits = [e for e in run.events() if e.key == "file" and e.accepted and e.to_state == "WAITING"]
    assert len(waits) == 2 and all("not yet" in (e.reason or "") for e in waits), waits
    assert_verified(orc, run.id, other.id)


def test_a_deferred_task_is_resumed_with_its_event_and_state(orc: Orchestrator, worker: WorkerProcess) -> None:
    key = unique("export.done")
    dag = DAG("it-defer")
    dag.task("job", P + "deferring", kwargs={"event": key, "match": {"id": 7}, "state": {"cursor": 3}})
    dag.task("after", P + "echo", upstream=["job"])
    run = orc.submit(dag)
    waiting = until_state(run, "job", T.WAITING)
    assert (waiting.attempt, waiting.worker) == (1, None)
    assert orc.events.emit(key, {"id": 8}).woken == 0
    assert orc.events.emit(key, {"id": 7, "url": "s3://x"}).woken == 1
    assert run.wait(timeout=30).state is RunState.SUCCEEDED

    job = run.task("job")
    resumed = job.result["resumed"]
    assert resumed["event"] == {"id": 7, "url": "s3://x"} and resumed["state"] == {"cursor": 3}
    assert resumed.get("timed_out") in (None, False)
    assert job.result["attempt"] == job.attempt == 2
    assert run.task("after").result["upstream"] == {"job": job.result}
    # called twice (deferred once, resumed once); one accepted outcome
    assert claims(run, "job") == 2
    outcomes = Counter(e.to_state for e in run.events() if e.key == "job" and e.accepted)
    assert outcomes["WAITING"] == 1 and outcomes["SUCCEEDED"] == 1, outcomes
    assert_verified(orc, run.id)


def test_an_approval_answered_while_the_worker_runs(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("it-approval")
    dag.task("build", P + "noop")
    dag.approval("ok", upstream=["build"], timeout=300)
    dag.task("ship", P + "echo", upstream=["ok"])
    run = orc.submit(dag)
    until_state(run, "ok", T.WAITING)
    time.sleep(0.5)  # a few reconciler passes: nothing answers an approval but a person
    assert run.task("ok").state is T.WAITING and run.task("ship").state is T.PENDING

    orc.approve(run.id, "ok", by="carol", comment="ship it")
    assert run.wait(timeout=30).state is RunState.SUCCEEDED
    answer = {"approved": True, "by": "carol", "comment": "ship it"}
    assert run.task("ok").result == answer
    assert run.task("ship").result == {"kwargs": {}, "upstream": {"ok": answer}}
    approved = [e for e in run.events() if e.key == "ok" and e.accepted and e.to_state == "SUCCEEDED"]
    assert len(approved) == 1 and approved[0].by == "carol"

    # a rejection fails the step and its downstream, as a person meant
    no = orc.submit(dag)
    until_state(no, "ok", T.WAITING)
    orc.reject(no.id, "ok", by="dave")
    assert no.wait(timeout=30).state is RunState.FAILED
    assert no.task("ok").error == "Rejected: rejected by dave" and no.task("ship").state is T.UPSTREAM_FAILED
    assert_verified(orc, run.id, no.id)


def test_a_body_deferring_after_its_event_came_is_resumed_at_once(orc: Orchestrator, worker: WorkerProcess) -> None:
    key = unique("export.early")
    assert orc.events.emit(key, {"id": 7, "early": True}).woken == 0  # nothing waits yet
    dag = DAG("it-defer-early")
    dag.task("job", P + "deferring", kwargs={"event": key, "match": {"id": 7}, "state": {"cursor": 1}})
    run = orc.submit(dag)
    assert run.wait(timeout=30).state is RunState.SUCCEEDED
    job = run.task("job")
    assert job.result["resumed"]["event"] == {"id": 7, "early": True} and job.attempt == 2
    woke = [e for e in run.events() if e.key == "job" and e.from_state == "WAITING" and e.accepted]
    assert len(woke) == 1 and "lookback" in (woke[0].reason or ""), woke
    assert_verified(orc, run.id)
