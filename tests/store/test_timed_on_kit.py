"""Waits and deadlines whose time passes, on the test kit's virtual clock
(``orchestrator.testing``): a day's sleep, an hour's timeout that fails or skips its wait, an
operator's retry of a timed-out wait, a deferred body's timeout, deadlines met by a quick run.
Each ran with real sleeps of tenths of a second before the kit; now the durations are the ones
a DAG would use and no test waits in real time."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from orchestrator import DAG, Defer, TaskState
from orchestrator.testing import Kit, emit

pytestmark = pytest.mark.postgres

NOOP, ECHO = "tasks.probes.noop", "tasks.probes.echo"
T = TaskState


def order_flow(**wait: Any) -> DAG:
    dag = DAG("orders")
    dag.task("a", NOOP)
    dag.wait("paid", event="order.paid", match={"order_id": 42}, upstream=["a"], **wait)
    dag.task("b", ECHO, upstream=["paid"])
    return dag


def test_a_days_sleep_ends_by_the_reconcilers_pass(orchestrator: Kit) -> None:
    dag = DAG("nap")
    dag.wait("nap", delay=24 * 3600)
    dag.task("after", NOOP, upstream=["nap"])
    waiting = orchestrator.run_dag(dag, auto_advance=False)
    assert waiting.states == {"nap": T.WAITING, "after": T.PENDING}
    orchestrator.clock.advance(hours=23, minutes=59)
    assert orchestrator.reconcile()["waits_woken"] == 0  # not yet
    orchestrator.clock.advance(minutes=2)
    assert orchestrator.reconcile()["waits_woken"] == 1
    done = waiting.resume(auto_advance=False)
    assert done.state == "SUCCEEDED" and done.results["nap"] is None
    assert done.elapsed >= dt.timedelta(hours=24)  # virtual time: the test took well under a second


def test_an_hours_timeout_fails_the_wait_or_skips_it(orchestrator: Kit) -> None:
    failed = orchestrator.run_dag(order_flow(timeout=3600))
    assert failed.states["paid"] == T.FAILED and failed.errors["paid"].startswith("WaitTimeout: waited for event")
    assert failed.states["b"] == T.UPSTREAM_FAILED and failed.state == "FAILED"
    assert orchestrator.emit("order.paid", {"order_id": 42}).woken == 0  # too late: nothing waits
    # lookback 0: not the late event above
    skipped = orchestrator.run_dag(order_flow(timeout=3600, on_timeout="skip", lookback=0))
    assert skipped.task("paid").skip_reason == "wait_timeout"
    assert skipped.states["b"] == T.SKIPPED and skipped.state == "SUCCEEDED"


def test_an_operators_retry_of_a_timed_out_wait_waits_again(orchestrator: Kit) -> None:
    failed = orchestrator.run_dag(order_flow(timeout=3600))
    assert failed.state == "FAILED"
    orchestrator.orc.retry_task(failed.handle.id, "paid", by="alice")
    again = failed.resume(auto_advance=False)
    assert again.states["paid"] == T.WAITING and again.state == "RUNNING"
    done = again.resume(events=[emit("order.paid", {"order_id": 42})])
    assert done.state == "SUCCEEDED" and done.results["paid"] == {"order_id": 42}


def test_a_deferred_body_that_times_out_fails_with_wait_timeout(orchestrator: Kit) -> None:
    def export() -> None:
        raise Defer(event="export.done", timeout=6 * 3600)

    dag = DAG("export")
    dag.task("job", "tasks.probes.noop")
    result = orchestrator.run_dag(dag, tasks={"tasks.probes.noop": export})
    assert result.states["job"] == T.FAILED and result.errors["job"].startswith("WaitTimeout")
    assert result.elapsed.total_seconds() >= 6 * 3600


def test_deadlines_that_fall_due_after_a_quick_run_are_judged_met(orchestrator: Kit) -> None:
    # Given a run with an hour's deadline (after its submit) and a node deadline, done at once
    dag = DAG("quick", deadline=3600, on_deadline="cancel")
    dag.task("a", NOOP, deadline=3600)
    done = orchestrator.run_dag(dag)
    assert done.state == "SUCCEEDED"
    assert orchestrator.reconcile()["deadlines_missed"] == 0  # not due yet: not judged

    # When the deadlines fall due
    orchestrator.clock.advance(hours=1, seconds=1)
    report = orchestrator.reconcile()

    # Then they are judged met: no miss, no cancel, no error, and the run stays SUCCEEDED
    assert (report["deadlines_missed"], report["deadline_cancels"], report["errors"]) == (0, 0, 0)
    after = done.resume(auto_advance=False)
    assert after.state == "SUCCEEDED"
    assert not [e for e in after.ledger if (e.reason or "").startswith("deadline missed")]
