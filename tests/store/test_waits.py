"""Waits and events (issue 20), every new transition on a real Postgres: a wait node begins
waiting (PENDING -> WAITING) and is woken by its event (-> SUCCEEDED with the payload), by its
instant (the reconciler's pass), or times out (FAILED WaitTimeout / SKIPPED); an event that came
before the wait is found by looking back; a duplicate event id wakes nothing; signals reach
one run; approvals; a cancel while waiting; an operator's retry of a timed-out wait; a body
that defers (RUNNING -> WAITING -> READY, called again with its state); a sensor in reschedule
mode; emits racing waits that begin at the same moment. The workers' part is
``dynamic.drive``. The waits whose time passes (a sleep, a timeout) are in
``test_timed_on_kit.py``, on the test kit's virtual clock."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Defer, Orchestrator, ValidationError
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.errors import OperatorError
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def states(orc: Orchestrator, run_id: str) -> dict[str, str]:
    return {t.key: t.state.value for t in orc.tasks(run_id)}


def row(orc: Orchestrator, run_id: str, key: str) -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run_id, s.tasks.c.key == key)).one()


def ledger(orc: Orchestrator, run_id: str, key: str) -> list[tuple[str | None, str, bool]]:
    return [(e.from_state, e.to_state, e.accepted) for e in orc.ledger(run_id) if e.key == key]


def clean(orc: Orchestrator, *run_ids: str) -> None:
    assert check_runs(orc.store, list(run_ids)) == []


def order_flow(**wait: Any) -> DAG:
    dag = DAG("orders")
    dag.task("a", "t")
    dag.wait("paid", event="order.paid", match={"order_id": 42}, upstream=["a"], **wait)
    dag.task("b", "up", upstream=["paid"])
    return dag


def test_an_event_wakes_its_wait_and_its_payload_is_the_result(orc: Orchestrator) -> None:
    d = drive(orc, order_flow())
    assert states(orc, d.run_id) == {"a": "SUCCEEDED", "paid": "WAITING", "b": "PENDING"}
    waiting = row(orc, d.run_id, "paid")
    assert waiting.wait_event == "order.paid" and waiting.wake_at is None and waiting.waiting["kind"] == "event"
    assert orc.events.emit("order.paid", {"order_id": 41}).woken == 0  # no match
    assert orc.events.emit("order.other", {"order_id": 42}).woken == 0  # another key
    done = orc.events.emit("order.paid", {"order_id": 42, "amount": 9.5}, event_id="evt-1")
    assert (done.woken, done.duplicate) == (1, False)
    assert orc.task(d.run_id, "paid").result == {"order_id": 42, "amount": 9.5}
    again = orc.events.emit("order.paid", {"amount": 9.5, "order_id": 42}, event_id="evt-1")  # the same event again
    assert again.duplicate and again.woken == 0 and again.id == done.id
    d = drive(orc, order_flow(), run_id=d.run_id)
    assert d.ran[-1][0] == "b" and d.ran[-1][2] == {"paid": {"order_id": 42, "amount": 9.5}}
    assert d.run_state() == "SUCCEEDED"
    assert ledger(orc, d.run_id, "paid") == [("PENDING", "WAITING", True), ("WAITING", "SUCCEEDED", True)]
    clean(orc, d.run_id)


def test_a_wait_finds_an_event_that_came_before_it_within_its_lookback(orc: Orchestrator) -> None:
    orc.events.emit("order.paid", {"order_id": 42})
    d = drive(orc, order_flow())
    assert states(orc, d.run_id) == {"a": "SUCCEEDED", "paid": "SUCCEEDED", "b": "SUCCEEDED"}
    short = drive(orc, order_flow(lookback=0))  # only events after the wait began
    assert states(orc, short.run_id)["paid"] == "WAITING"
    root = DAG("root-wait")
    root.wait("w", event="order.paid", match={"order_id": 42})
    root.task("after", "t", upstream=["w"])
    started = drive(orc, root)
    assert states(orc, started.run_id) == {"w": "SUCCEEDED", "after": "SUCCEEDED"}
    clean(orc, d.run_id, started.run_id)


def test_events_and_waits_belong_to_their_tenant(orc: Orchestrator) -> None:
    dag = order_flow()
    acme = dag.with_tenant("acme")
    d = drive(orc, acme)
    assert orc.events.emit("order.paid", {"order_id": 42}).woken == 0  # the default tenant's event
    assert orc.events.emit("order.paid", {"order_id": 42}, tenant="other").woken == 0
    assert orc.events.emit("order.paid", {"order_id": 42}, tenant="acme").woken == 1
    assert states(orc, d.run_id)["paid"] == "SUCCEEDED"


def test_bad_events_are_refused_and_nothing_is_written(orc: Orchestrator) -> None:
    for kwargs in ({"key": "bad key"}, {"key": ""}, {"key": "k", "payload": [1]}, {"key": "k", "payload": {"x": {1}}},
                   {"key": "k", "payload": {"big": "x" * 70_000}}, {"key": "k", "event_id": ""},
                   {"key": "k", "tenant": "no such/tenant"}):  # fmt: skip
        with pytest.raises(ValidationError):
            orc.events.emit(**kwargs)
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.emitted)).scalar_one() == 0


def test_a_wait_for_a_past_instant_ends_at_once(orc: Orchestrator) -> None:
    # (a sleep that ends by the reconciler's pass: test_timed_on_kit.py, on the kit's clock)
    past = DAG("past")
    past.wait("w", until=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    d = drive(orc, past)
    assert states(orc, d.run_id) == {"w": "SUCCEEDED"}
    clean(orc, d.run_id)


def test_a_wall_time_in_a_zone_is_the_next_one(orc: Orchestrator) -> None:
    dag = DAG("nine")
    dag.wait("w", until="09:30", tz="Europe/Paris")
    run = orc.submit(dag)
    wake = row(orc, run.id, "w").wake_at.astimezone(__import__("zoneinfo").ZoneInfo("Europe/Paris"))
    now = dt.datetime.now(dt.UTC)
    assert (wake.hour, wake.minute) == (9, 30) and now < wake <= now + dt.timedelta(days=1, minutes=1)


def test_a_cancel_while_waiting_ends_the_wait(orc: Orchestrator) -> None:
    d = drive(orc, order_flow())
    orc.cancel(d.run_id, by="bob")
    assert states(orc, d.run_id)["paid"] == "CANCELLED"
    assert orc.events.emit("order.paid", {"order_id": 42}).woken == 0
    clean(orc, d.run_id)


def test_a_signal_reaches_one_run_only(orc: Orchestrator) -> None:
    dag = DAG("gate")
    dag.wait("go", event="go")
    first, second = orc.submit(dag), orc.submit(dag)
    assert first.signal("go", {"n": 1}).woken == 1
    assert states(orc, first.id) == {"go": "SUCCEEDED"} and states(orc, second.id) == {"go": "WAITING"}
    assert orc.task(first.id, "go").result == {"n": 1}
    other = orchestrator(orc.settings.database_url)
    bound = Orchestrator(other.settings, store=orc.store, publisher=orc.publisher, registry=orc.registry, tenant="x")
    with pytest.raises(Exception, match="no run"):
        bound.events.signal(second.id, "go")
    other.store.dispose()


def test_an_approval_is_answered_by_a_person(orc: Orchestrator) -> None:
    dag = DAG("deploy")
    dag.task("build", "t")
    dag.approval("ok", upstream=["build"])
    dag.task("ship", "t", upstream=["ok"])
    d = drive(orc, dag)
    assert states(orc, d.run_id)["ok"] == "WAITING"
    with pytest.raises(OperatorError, match="not waiting for an approval"):
        orc.approve(d.run_id, "build")
    assert orc.events.emit("approval", {}).woken == 0  # an event never answers an approval
    orc.approve(d.run_id, "ok", by="carol", comment="looks good")
    assert orc.task(d.run_id, "ok").result == {"approved": True, "by": "carol", "comment": "looks good"}
    approved = [e for e in orc.ledger(d.run_id) if e.key == "ok" and e.to_state == "SUCCEEDED"]
    assert approved[0].by == "carol" and "approved by carol" in (approved[0].reason or "")
    assert drive(orc, dag, run_id=d.run_id).run_state() == "SUCCEEDED"
    no = drive(orc, dag)
    orc.reject(no.run_id, "ok", by="dave")
    assert orc.task(no.run_id, "ok").error == "Rejected: rejected by dave"
    assert states(orc, no.run_id)["ship"] == "UPSTREAM_FAILED" and no.run_state() == "FAILED"
    with pytest.raises(OperatorError):
        orc.approve(no.run_id, "ok")
    clean(orc, d.run_id, no.run_id)


def test_a_body_that_defers_is_called_again_with_its_state(orc: Orchestrator) -> None:
    dag = DAG("poll")
    dag.task("job", "t", max_attempts=2)
    dag.task("after", "up", upstream=["job"])
    calls: list[str] = []

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        calls.append(key)
        if key == "job" and calls.count("job") == 1:
            raise Defer(event="export.done", match={"id": 7}, timeout=60, state={"cursor": 3})
        return {"got": up}

    d = drive(orc, dag, body)
    job = row(orc, d.run_id, "job")
    assert (job.state, job.attempt, job.max_attempts, job.worker) == ("WAITING", 1, 2, None)
    assert orc.events.emit("export.done", {"id": 7, "url": "s3://x"}).woken == 1
    job = row(orc, d.run_id, "job")
    assert (job.state, job.attempt, job.max_attempts) == ("QUEUED", 2, 3)  # admitted at once; its budget untouched
    d = drive(orc, dag, body, run_id=d.run_id)
    assert d.resumed["job"]["event"] == {"id": 7, "url": "s3://x"} and d.resumed["job"]["state"] == {"cursor": 3}
    assert d.run_state() == "SUCCEEDED" and calls == ["job", "job", "after"]
    assert ledger(orc, d.run_id, "job")[:4] == [
        ("PENDING", "READY", True), ("READY", "QUEUED", True), ("QUEUED", "RUNNING", True),
        ("RUNNING", "WAITING", True),
    ]  # fmt: skip
    clean(orc, d.run_id)


def test_a_defer_with_bad_fields_is_refused() -> None:
    for bad in (Defer(), Defer(delay=-1), Defer(event="bad key"), Defer(match={"a": 1}, delay=1),
                Defer(until="not a date"), Defer(delay=1, until="2030-01-01T00:00:00Z"),
                Defer(delay=1, on_timeout="x")):  # fmt: skip
        with pytest.raises(ValidationError):
            bad.spec()


def test_a_sensor_checks_again_without_holding_a_slot_until_it_says_yes(orc: Orchestrator) -> None:
    dag = DAG("sense")
    dag.sensor("file", "t", every=0.2, backoff=2.0, timeout=30)
    dag.task("after", "up", upstream=["file"])
    answers = iter([None, False, {"path": "/x"}])

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        return next(answers) if key == "file" else up

    d = drive(orc, dag, body)
    assert states(orc, d.run_id)["file"] == "WAITING" and row(orc, d.run_id, "file").worker is None
    for _ in range(2):
        due = row(orc, d.run_id, "file").wake_at
        while dt.datetime.now(dt.UTC) < due:
            time.sleep(0.05)
        orc.reconcile()
        d = drive(orc, dag, body, run_id=d.run_id)
    assert d.run_state() == "SUCCEEDED" and orc.task(d.run_id, "file").result == {"path": "/x"}
    assert d.resumed["file"]["state"] == {"checks": 2}
    waits = [e for e in orc.ledger(d.run_id) if e.key == "file" and e.to_state == "WAITING"]
    assert len(waits) == 2 and all("its check said not yet" in (e.reason or "") for e in waits)
    clean(orc, d.run_id)


def test_a_sensor_times_out_from_its_first_check(orc: Orchestrator) -> None:
    dag = DAG("never")
    dag.sensor("file", "t", every=0.1, timeout=0.4, on_timeout="skip")
    d = drive(orc, dag, lambda key, kw, up: None)
    deadline = row(orc, d.run_id, "file").waiting["deadline"]
    for _ in range(50):
        time.sleep(0.1)
        orc.reconcile()
        d = drive(orc, dag, lambda key, kw, up: None, run_id=d.run_id)
        if d.run_state() != "RUNNING":
            break
        assert row(orc, d.run_id, "file").waiting is None or row(orc, d.run_id, "file").waiting["deadline"] == deadline
    assert orc.task(d.run_id, "file").skip_reason == "wait_timeout" and d.run_state() == "SUCCEEDED"


def test_a_clear_of_a_waiting_task_and_of_a_succeeded_wait(orc: Orchestrator) -> None:
    d = drive(orc, order_flow())
    orc.events.emit("order.paid", {"order_id": 42}, event_id="e1")
    d = drive(orc, order_flow(), run_id=d.run_id)
    assert d.run_state() == "SUCCEEDED"
    orc.clear(d.run_id, "paid", downstream=True, by="erin")
    # cleared, it waits again and finds the event it already had by looking back
    assert states(orc, d.run_id)["paid"] == "SUCCEEDED"
    d = drive(orc, order_flow(), run_id=d.run_id)
    assert d.run_state() == "SUCCEEDED"
    clean(orc, d.run_id)


def test_wait_spec_round_trips_through_the_spec_format() -> None:
    dag = order_flow(timeout=30, on_timeout="skip", lookback=10)
    dag.wait("nap", until="09:30", tz="Europe/Paris", upstream=["b"])
    dag.approval("ok", upstream=["nap"], timeout=5)
    dag.sensor("file", "t", every=5, backoff=2, max_every=60, upstream=["ok"])
    again = dag_from_spec(dag.to_spec())
    assert again.to_spec() == dag.to_spec()
    for bad in ({"event": "k", "delay": 5}, {}, {"match": {"a": 1}, "delay": 1}, {"until": "25:00"},
                {"event": "k", "on_timeout": "retry"}, {"delay": 1, "tz": "Nowhere/City"}):  # fmt: skip
        with pytest.raises(ValidationError):
            dag_from_spec({"name": "x", "nodes": [{"key": "w", "wait": bad}]})
    with pytest.raises(ValidationError):
        dag_from_spec({"name": "x", "nodes": [{"key": "w", "task": "t", "wait": {"delay": 1}}]})


def test_emits_racing_waits_that_begin_at_the_same_moment_wake_each_once(orc: Orchestrator) -> None:
    """Each pair: a run whose root waits for event k and an emit of k, started together: the
    key's lock orders them, so either the emit finds the wait or the wait finds the event."""
    dag = DAG("race")
    dag.wait("w", event="race", match={"k": 0})
    pairs = 40
    runs: list[str] = []
    barrier = threading.Barrier(2)

    def waiter(k: int) -> None:
        spec = dag.to_spec()
        spec["name"] = "race"
        spec["nodes"][0]["wait"]["match"] = {"k": k}
        built = dag_from_spec(spec)
        barrier.wait()
        runs.append(orc.submit(built).id)

    def emitter(k: int) -> None:
        barrier.wait()
        orc.events.emit("race", {"k": k})

    for k in range(pairs):
        threads = [threading.Thread(target=waiter, args=(k,)), threading.Thread(target=emitter, args=(k,))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    got = [states(orc, r)["w"] for r in runs]
    assert got.count("SUCCEEDED") == pairs, got
    with orc.store.engine.connect() as conn:
        woke = conn.execute(sa.select(sa.func.sum(s.emitted.c.woke))).scalar_one()
    twice = [r for r in runs if sum(1 for e in orc.ledger(r) if e.key == "w" and e.to_state == "SUCCEEDED") != 1]
    assert twice == [] and woke <= pairs
