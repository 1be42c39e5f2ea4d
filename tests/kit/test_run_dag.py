"""``run_dag``: a DAG run in the test's process through the production transitions, with
faults and events as inputs and the virtual clock standing in for waiting."""

from __future__ import annotations

import datetime as dt

import pytest

from orchestrator import DAG, Backoff, Jitter, RunState, TaskState
from orchestrator.testing import (
    CrashWorker,
    FailTimes,
    Kit,
    KitError,
    LoseDispatch,
    approve,
    emit,
    reject,
    run_dag,
    signal,
)
from tests.kit.kit_tasks import CALLS

pytestmark = pytest.mark.postgres

S = TaskState


def ledger(result: object, key: str) -> list[tuple[str | None, str, str]]:
    return [(e.from_state, e.to_state, e.actor) for e in result.ledger if e.key == key]  # type: ignore[attr-defined]


def test_a_run_through_the_real_tasks() -> None:
    """``run_dag`` without naming a fixture: the plugin makes the test's kit on first use."""
    dag = DAG("sums")
    a = dag.task("a", "kit.value", kwargs={"x": 2})
    b = dag.task("b", "kit.value", kwargs={"x": 3})
    dag.task("sum", "kit.total", upstream=[a, b])
    result = run_dag(dag)
    assert result.state == RunState.SUCCEEDED
    assert result.states == {"a": S.SUCCEEDED, "b": S.SUCCEEDED, "sum": S.SUCCEEDED}
    assert result.results == {"a": 2, "b": 3, "sum": 5.0}
    assert result.attempts == {"a": 1, "b": 1, "sum": 1}
    # the worker's own transitions, claimed by the kit's worker
    assert ledger(result, "sum") == [
        ("PENDING", "READY", "worker"), ("READY", "QUEUED", "dispatcher"), ("QUEUED", "RUNNING", "worker"),
        ("RUNNING", "SUCCEEDED", "worker"),
    ]  # fmt: skip
    assert [c[0] for c in CALLS] == ["value", "value", "total"]
    assert "SUCCEEDED" in result.explain("sum")


def test_retries_follow_their_backoff_in_virtual_time(orchestrator: Kit) -> None:
    dag = DAG("pay")
    dag.task(
        "charge", "kit.charge", kwargs={"amount": 12.5}, max_attempts=3,
        backoff=Backoff(base=600, cap=3600, jitter=Jitter.NONE),
    )  # fmt: skip
    # ConnectionError is an infrastructure fault: it never counts as a poisoned task
    result = orchestrator.run_dag(dag, faults={"charge": FailTimes(2, exc=ConnectionError)})
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["charge"] == {"charged": 12.5}
    assert result.attempts["charge"] == 3
    assert [d.outcome for d in result.deliveries] == ["failed", "failed", "ran"]
    retried = [e for e in result.ledger if e.key == "charge" and e.to_state == "RETRYING"]
    released = [e for e in result.ledger if e.key == "charge" and e.reason == "retry due"]
    assert len(retried) == 2 and len(released) == 2
    for fail, due, wait in zip(retried, released, (600, 1200), strict=True):
        assert fail.at is not None and due.at is not None
        assert dt.timedelta(seconds=wait) <= due.at - fail.at < dt.timedelta(seconds=wait + 5)
    assert result.elapsed >= dt.timedelta(seconds=1800)


def test_the_same_failure_twice_is_a_poison_as_in_production(orchestrator: Kit) -> None:
    dag = DAG("pay")
    dag.task("charge", "kit.charge", kwargs={"amount": 1}, max_attempts=5)
    result = orchestrator.run_dag(dag, faults={"charge": FailTimes(2, exc=TimeoutError)})
    assert result.states["charge"] == S.DEAD_LETTER  # poison_threshold=2: a person decides
    assert result.state == "RUNNING"
    assert "TimeoutError" in (result.task("charge").error or "")
    assert [c[0] for c in CALLS] == []  # the fault stood in for the body both times
    # an operator's retry, and the body runs
    result.handle.retry("charge", by="test")
    again = result.resume()
    assert again.state == "SUCCEEDED" and again.attempts["charge"] == 3


def test_a_lost_message_is_republished_by_the_reconciler(orchestrator: Kit) -> None:
    dag = DAG("lossy")
    dag.task("a", "kit.value", kwargs={"x": "a"})
    result = orchestrator.run_dag(dag, faults={"a": LoseDispatch()})
    assert result.state == "SUCCEEDED", result.explain()
    assert [d.outcome for d in result.deliveries] == ["lost", "ran"]
    republished = [e for e in result.ledger if e.key == "a" and e.from_state == "QUEUED" and e.to_state == "QUEUED"]
    assert len(republished) == 1 and republished[0].actor == "reconciler"
    assert "dispatch timeout" in (republished[0].reason or "")
    assert result.attempts["a"] == 1  # the same attempt, published again
    assert result.elapsed >= dt.timedelta(seconds=orchestrator.settings.dispatch_timeout)


def test_a_worker_crash_mid_task_expires_its_lease(orchestrator: Kit) -> None:
    dag = DAG("crashy")
    dag.task("a", "kit.value", kwargs={"x": 7}, max_attempts=2)
    result = orchestrator.run_dag(dag, faults={"a": CrashWorker()})
    assert result.state == "SUCCEEDED", result.explain()
    assert [d.outcome for d in result.deliveries] == ["crashed", "ran"]
    expired = [e for e in result.ledger if e.key == "a" and e.from_state == "RUNNING" and e.to_state == "RETRYING"]
    assert len(expired) == 1 and expired[0].actor == "reconciler"
    assert "LeaseExpired" in (expired[0].reason or "")
    assert result.attempts["a"] == 2
    assert result.elapsed >= dt.timedelta(seconds=orchestrator.settings.lease_seconds)


def test_crashes_in_a_row_are_a_crash_loop(orchestrator: Kit) -> None:
    dag = DAG("crashy")
    dag.task("a", "kit.value", max_attempts=5)
    result = orchestrator.run_dag(dag, faults={"a": CrashWorker(times=5)})
    assert result.states["a"] == S.DEAD_LETTER
    assert "crash loop" in (result.task("a").error or "")


def test_a_result_that_is_no_json_fails_the_run(orchestrator: Kit) -> None:
    dag = DAG("bad")
    dag.task("when", "kit.when", max_attempts=3)
    result = orchestrator.run_dag(dag)
    assert result.state == "FAILED"
    assert result.states["when"] == S.FAILED
    assert result.attempts["when"] == 1  # not retried: the code is wrong, not the weather
    assert "JSON" in (result.task("when").error or "")
    with pytest.raises(AssertionError, match="when FAILED"):
        result.assert_succeeded()


def test_arguments_cross_a_json_round_trip(orchestrator: Kit) -> None:
    """A task's arguments reach its body as the JSON a broker carries: a tuple is a list."""
    dag = DAG("args")
    dag.task("a", "kit.value", kwargs={"x": {"pair": (1, 2), "n": 1.5}})
    result = orchestrator.run_dag(dag)
    assert result.results["a"] == {"pair": [1, 2], "n": 1.5}
    assert CALLS == [("value", 1, {"x": {"pair": [1, 2], "n": 1.5}})]


def test_a_map_and_a_branch(orchestrator: Kit) -> None:
    dag = DAG("mapped")
    items = dag.task("items", "kit.listing", kwargs={"n": 3})
    dag.map("squares", "kit.square", over=items, kwarg="item", max_attempts=2)
    pick = dag.task("pick", "kit.pick", upstream=["squares"], branch=True)
    dag.task("big", "kit.value", kwargs={"x": "big"}, upstream=[pick])
    dag.task("small", "kit.value", kwargs={"x": "small"}, upstream=[pick])
    result = orchestrator.run_dag(dag, faults={"squares": FailTimes(1, exc=ConnectionError)})
    assert result.state == "SUCCEEDED", result.explain()
    assert result.states["squares"] == S.SUCCEEDED and result.attempts["squares[0]"] == 2
    assert [result.results[f"squares[{i}]"] for i in range(3)] == [1, 4, 9]
    assert result.results["pick"] == "big"
    assert result.states["small"] == S.SKIPPED and result.states["big"] == S.SUCCEEDED


def test_events_signals_and_approvals_as_inputs(orchestrator: Kit) -> None:
    dag = DAG("order")
    first = dag.task("first", "kit.value")
    paid = dag.wait("paid", event="order.paid", match={"order": 42}, upstream=[first], timeout=7 * 86400)
    go = dag.wait("go", event="go", upstream=[paid])
    review = dag.approval("review", upstream=[go])
    dag.task("ship", "kit.value", kwargs={"x": "shipped"}, upstream=[review])
    result = orchestrator.run_dag(
        dag,
        events=[
            emit("order.paid", {"order": 41}),  # matches nothing: the wait goes on
            emit("order.paid", {"order": 42, "amount": 5}, after=3 * 3600),
            signal("go", {"ok": True}),
            approve("review", comment="fine"),
        ],
    )
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["paid"] == {"order": 42, "amount": 5}
    assert result.results["go"] == {"ok": True}
    assert result.results["review"]["approved"] is True and result.results["review"]["comment"] == "fine"
    assert dt.timedelta(hours=3) <= result.elapsed < dt.timedelta(hours=4)
    answered = [e for e in result.ledger if e.key == "review" and e.to_state == "SUCCEEDED"]
    assert answered and "test" in (answered[0].by or answered[0].reason or "")


def test_a_rejection_and_a_wait_that_times_out(orchestrator: Kit) -> None:
    dag = DAG("order")
    dag.approval("review")
    dag.wait("paid", event="order.paid", timeout=3600, on_timeout="skip")
    result = orchestrator.run_dag(dag, events=[reject("review", comment="no")])
    assert result.states == {"review": S.FAILED, "paid": S.SKIPPED}
    assert "Rejected" in (result.task("review").error or "")
    assert result.elapsed >= dt.timedelta(hours=1)


def test_the_facade_acts_at_once_and_resume_goes_on(orchestrator: Kit) -> None:
    dag = DAG("order")
    dag.approval("review")
    dag.task("ship", "kit.value", upstream=["review"])
    waiting = orchestrator.run_dag(dag)
    assert waiting.state == "RUNNING" and waiting.states["review"] == S.WAITING
    assert "approval" in waiting.explain("review")
    orchestrator.approve(waiting, "review", by="alice")
    done = waiting.resume()
    assert done.state == "SUCCEEDED" and done.results["review"]["by"] == "alice"


def test_a_sensor_and_a_deferring_body(orchestrator: Kit) -> None:
    dag = DAG("sensing")
    dag.sensor("ready", "kit.ready_after", kwargs={"checks": 3}, every=600)
    dag.task("later", "kit.later", kwargs={"hours": 6}, upstream=["ready"])
    result = orchestrator.run_dag(dag)
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["ready"] == {"after_checks": 3}
    assert result.results["later"]["resumed"]["state"] == {"first_attempt": 1}
    assert [c[2] for c in CALLS if c[0] == "ready_after"] == [{"check": 1}, {"check": 2}, {"check": 3}]
    assert result.elapsed >= dt.timedelta(hours=6, minutes=20)


def test_a_stand_in_for_a_task(orchestrator: Kit) -> None:
    """``tasks={name: function}`` replaces a task's body (a fake payment API) and still runs
    it through the worker's code."""
    seen: list[float] = []

    def fake_charge(amount: float) -> dict[str, str]:
        seen.append(amount)
        return {"fake": "ok"}

    dag = DAG("pay")
    dag.task("charge", "kit.charge", kwargs={"amount": 3.0})
    result = orchestrator.run_dag(dag, tasks={"kit.charge": fake_charge})
    assert result.results == {"charge": {"fake": "ok"}} and seen == [3.0]
    assert CALLS == []


def test_a_deadline_missed_in_virtual_time(orchestrator: Kit) -> None:
    dag = DAG("slow", deadline=3600)
    dag.wait("nap", delay=2 * 3600)
    result = orchestrator.run_dag(dag)
    assert result.state == "SUCCEEDED"
    assert any(e.kind == "deadline_missed" for e in result.ledger)


def test_a_run_that_can_only_wait_is_returned_as_it_is(orchestrator: Kit) -> None:
    dag = DAG("forever")
    dag.wait("never", event="never")
    result = orchestrator.run_dag(dag)
    assert result.state == "RUNNING" and result.states == {"never": S.WAITING}


def test_an_unknown_task_is_refused_before_anything_runs(orchestrator: Kit) -> None:
    dag = DAG("typo")
    dag.task("a", "kit.no_such_task")
    with pytest.raises(Exception, match="not registered"):
        orchestrator.run_dag(dag)


def test_an_event_input_goes_to_the_run_s_tenant(orchestrator: Kit) -> None:
    dag = DAG("tenanted", tenant="acme")
    dag.wait("paid", event="order.paid")
    result = orchestrator.run_dag(dag, events=[emit("order.paid", {"order": 1})])
    assert result.state == "SUCCEEDED" and result.results["paid"] == {"order": 1}


def test_an_input_that_cannot_be_delivered_says_why(orchestrator: Kit) -> None:
    dag = DAG("late_review")
    dag.wait("never", event="never")
    dag.approval("review", upstream=["never"])  # never reached: nothing to approve
    with pytest.raises(KitError, match="approve\\('review'\\) could not be delivered"):
        orchestrator.run_dag(dag, events=[approve("review")])


def test_a_fault_or_an_answer_for_no_node_is_refused(orchestrator: Kit) -> None:
    dag = DAG("pay")
    dag.task("charge", "kit.charge", kwargs={"amount": 1})
    with pytest.raises(KitError, match="chrage"):
        orchestrator.run_dag(dag, faults={"chrage": FailTimes(1)})
    with pytest.raises(KitError, match="review"):
        orchestrator.run_dag(dag, events=[approve("review")])
    assert orchestrator.orc.runs() == []  # refused before anything was submitted


def test_each_test_starts_with_an_empty_database(orchestrator: Kit) -> None:
    """The tests above made runs; this one sees none of them."""
    assert orchestrator.orc.runs() == []


def test_the_tasks_of_another_app_of_the_process(orchestrator: Kit) -> None:
    """A project that made its own app (``create_app``) rather than the default one."""
    from orchestrator.runtime.celery_app import create_app

    other = create_app(main="other")

    @other.task(name="other.double")  # type: ignore[untyped-decorator]
    def double(x: int) -> int:
        return 2 * x

    dag = DAG("other")
    dag.task("d", "other.double", kwargs={"x": 4})
    assert orchestrator.run_dag(dag).results == {"d": 8}


def test_a_long_body_is_kept_alive_by_the_worker_s_heartbeats(orchestrator: Kit) -> None:
    """The process's heartbeater beats through the kit's database while a body outlives a third
    of its lease: the attempt is never taken over (in real time: a lease of
    ORCHESTRATOR_LEASE_SECONDS, 5 s in this suite)."""
    import sqlalchemy as sa

    from orchestrator.store import schema as s

    lease = orchestrator.settings.lease_seconds
    dag = DAG("slow")
    dag.task("slow", "kit.slow", kwargs={"seconds": min(lease / 3 + 0.8, 10.0)})
    result = orchestrator.run_dag(dag, auto_advance=False)
    assert result.state == "SUCCEEDED" and result.attempts["slow"] == 1, result.explain()
    with orchestrator.db.engine.connect() as conn:
        row = conn.execute(sa.select(s.tasks.c.started_at, s.tasks.c.heartbeat_at)).one()
    assert row.heartbeat_at is not None and row.heartbeat_at > row.started_at
