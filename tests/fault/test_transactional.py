"""A transactional task's own writes, exactly once, on real workers (``dag.task(...,
transactional=True)``): the probe ``txn_insert`` inserts one row into ``txn_probe.writes`` on its
attempt's transaction, and the row is counted from the database after each fault: the worker
killed between its writes and its commit, the same message delivered twice, the lease lost while
the body runs, and a clear while it runs. The table has no unique key: nothing but the
transaction keeps a second row out. The body's executions are counted apart (the probe effects,
committed at once on a connection of their own), so each test shows the body ran more than once
and its row was written once."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, P, accepted, rejected, worker_pid

pytestmark = pytest.mark.fault
T = TaskState
#: the lease, and the transactional task's hard time limit (at most the lease: submit refuses more)
LEASE = "10"
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}


def writes_table(cluster: Cluster) -> None:
    """The probe's table, in a schema of its own, emptied."""
    with cluster.store.engine.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA IF NOT EXISTS txn_probe"))
        conn.execute(
            sa.text(
                "CREATE TABLE IF NOT EXISTS txn_probe.writes (run_id text NOT NULL, key text NOT NULL,"
                " attempt integer NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now())"
            )
        )
        conn.execute(sa.text("DELETE FROM txn_probe.writes"))


def writes(cluster: Cluster, run_id: str) -> list[int]:
    """The attempts whose row of ``run_id`` is in the table (committed), in order."""
    with cluster.store.engine.connect() as conn:
        query = sa.text("SELECT attempt FROM txn_probe.writes WHERE run_id = :run ORDER BY attempt")
        return list(conn.execute(query, {"run": run_id}).scalars())


def one_task(name: str, gate: Path | None = None) -> DAG:
    """One transactional ``a`` (its first attempt held until ``gate`` exists, when given)."""
    dag = DAG(name)
    kwargs: dict[str, Any] = {"gate": str(gate), "hold_attempts": 1} if gate is not None else {}
    dag.task(
        "a", P + "txn_insert", kwargs=kwargs, max_attempts=3, backoff=FAST_BACKOFF, transactional=True,
        time_limit=float(LEASE),
    )  # fmt: skip
    return dag


def body_ran(cluster: Cluster, run_id: str, attempt: int) -> None:
    """Until attempt ``attempt``'s body wrote its row (uncommitted) and recorded its execution."""
    cluster.wait_for(
        lambda: cluster.effects(run_id)[("a", attempt)] == 1, 60, f"attempt {attempt}'s body", run_id=run_id
    )


def exactly_once(cluster: Cluster, run_id: str, attempt: int) -> None:
    """The run SUCCEEDED with one accepted success, of ``attempt``, and one row, of ``attempt``."""
    assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
    assert writes(cluster, run_id) == [attempt]
    events = cluster.events(run_id)
    assert [e.attempt for e in accepted(events, dst="SUCCEEDED")] == [attempt]
    task = cluster.store.reads.get_task(run_id, "a")
    assert task.attempt == attempt and task.result["attempt"] == attempt


def test_killed_between_its_writes_and_its_commit(cluster: Cluster, tmp_path: Path) -> None:
    # Given a worker armed to die after the body's write and the success's compare-and-set, before
    # the commit (the first time only)
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS=LEASE, ORCHESTRATOR_WORKER_RECONCILER="0")
    writes_table(cluster)
    marker = tmp_path / "crashed-once"
    crash = {"ORCHESTRATOR_CRASH_AT": "before_transaction_commit", "ORCHESTRATOR_CRASH_MARKER": str(marker)}
    w1 = cluster.worker("w1", concurrency=1, env=crash)
    cluster.reconciler()

    # When the transactional task runs and its pool process is killed (SIGKILL) before its commit
    run = cluster.orc.submit(one_task("txn-kill"))
    cluster.wait_for(marker.exists, 60, "the pool process killed before its commit", run_id=run.id)

    # Then neither the write nor the success was committed; the lease expires, attempt 2 runs the
    # body again and commits it: one row, attempt 2's
    assert 1 not in writes(cluster, run.id)
    assert not accepted(cluster.events(run.id), dst="SUCCEEDED")
    exactly_once(cluster, run.id, 2)
    cluster.wait_for(lambda: "signal 9 (SIGKILL)" in w1.text(), 30, "the lost child", run_id=run.id)
    events = cluster.events(run.id)
    assert [(e.attempt, e.actor) for e in accepted(events, src="RUNNING", dst="RETRYING")] == [(1, "reconciler")]
    assert cluster.effects(run.id) == {("a", 1): 1, ("a", 2): 1}, "the body ran twice, its row is there once"
    cluster.assert_clean([run.id])


@pytest.mark.parametrize("claim_delay", ["0", "0.2"])
def test_the_same_message_delivered_twice(cluster: Cluster, tmp_path: Path, claim_delay: str) -> None:
    # Given two idle single-slot workers (with a claim delay, a direct message's body would start
    # before its claim: a transactional task's message is never direct), no reconciler to add copies
    cluster.configure(
        ORCHESTRATOR_LEASE_SECONDS=LEASE, ORCHESTRATOR_CLAIM_DELAY=claim_delay, ORCHESTRATOR_WORKER_RECONCILER="0",
        ORCHESTRATOR_DISPATCH_TIMEOUT="300",
    )  # fmt: skip
    writes_table(cluster)
    wa, wb = cluster.start_worker("wa", concurrency=1), cluster.start_worker("wb", concurrency=1)
    cluster.wait_ready(wa, wb)
    gate = tmp_path / "gate"
    orc = cluster.orc
    dag = one_task("txn-double", gate)
    orc.check(dag)
    run_id, _ = orc.store.submission.create_run(
        dag, queues={"a": "orchestrator.default"}, wants_upstream=orc.registry.wants_upstream
    )
    dispatches = orc.store.admission.admit_ready(orc.settings.dispatch_window)
    assert [(d.key, d.attempt, d.direct) for d in dispatches] == [("a", 1, False)]

    # When its message is published twice at once, the winner's body holding its write uncommitted
    assert orc.publisher.publish(dispatches + dispatches) == 2
    body_ran(cluster, run_id, 1)
    refused = cluster.wait_for(
        lambda: rejected(cluster.events(run_id), dst="RUNNING", actor="worker"), 60, "the copy's refused claim",
        run_id=run_id,
    )  # fmt: skip
    assert writes(cluster, run_id) == [], "the write is not committed while the body runs"
    gate.touch()

    # Then one claim won and committed one row; the copy never ran the body; a third copy after
    # the success is refused as well
    exactly_once(cluster, run_id, 1)
    assert orc.publisher.publish(dispatches) == 1
    cluster.wait_for(
        lambda: len(rejected(cluster.events(run_id), dst="RUNNING")) == 2, 60, "the late copy refused", run_id=run_id
    )
    assert [(e.key, e.attempt) for e in refused] == [("a", 1)]
    assert writes(cluster, run_id) == [1]
    assert cluster.effects(run_id) == {("a", 1): 1}
    cluster.assert_clean([run_id])


def test_the_lease_lost_while_the_body_holds_its_writes(cluster: Cluster, tmp_path: Path) -> None:
    # Given attempt 1's body on w1, its row written and not committed
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS=LEASE, ORCHESTRATOR_WORKER_RECONCILER="0")
    writes_table(cluster)
    gate = tmp_path / "gate"
    w1 = cluster.worker("w1", concurrency=1)
    cluster.reconciler()
    run = cluster.orc.submit(one_task("txn-lease", gate))
    a = cluster.wait_task(run.id, "a", lambda t: t.state is T.RUNNING, 60, "a running")
    assert a.attempt == 1 and os.getpgid(worker_pid(a)) == w1.pid
    body_ran(cluster, run.id, 1)

    # When w1 is paused (its heartbeat with it) past the lease: the reconciler takes the attempt
    # over, and attempt 2 runs on w2 and commits its own row
    w1.signal_group(signal.SIGSTOP)
    cluster.worker("w2", concurrency=1)
    exactly_once(cluster, run.id, 2)

    # Then, resumed and let go, attempt 1 cannot commit: its outcome is refused, its row rolled back
    w1.signal_group(signal.SIGCONT)
    gate.touch()

    def stopped() -> list[Any]:
        return [e for e in rejected(cluster.events(run.id)) if e.key == "a" and e.attempt == 1]

    refused = cluster.wait_for(stopped, 60, "attempt 1's outcome refused", run_id=run.id)
    print("attempt 1 refused: " + "; ".join(f"-> {e.to_state}: {e.reason}" for e in refused))
    assert writes(cluster, run.id) == [2]
    events = cluster.events(run.id)
    assert [(e.attempt, e.actor) for e in accepted(events, src="RUNNING", dst="RETRYING")] == [(1, "reconciler")]
    assert cluster.effects(run.id) == {("a", 1): 1, ("a", 2): 1}
    cluster.assert_clean([run.id])


def test_a_clear_while_the_body_holds_its_writes(cluster: Cluster, tmp_path: Path) -> None:
    # Given attempt 1's body running, its row written and not committed
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS=LEASE, ORCHESTRATOR_WORKER_RECONCILER="0")
    writes_table(cluster)
    gate = tmp_path / "gate"
    cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(one_task("txn-clear", gate))
    body_ran(cluster, run.id, 1)
    assert writes(cluster, run.id) == []
    pid = worker_pid(cluster.store.reads.get_task(run.id, "a"))

    # When an operator clears it
    assert cluster.orc.clear(run.id, "a", by="fault-test") == ["a"]

    # Then attempt 1 is stopped (terminated by the revoke, or fenced at its heartbeat) with its
    # write rolled back; attempt 2 runs the body again and commits: one row, attempt 2's
    exactly_once(cluster, run.id, 2)
    assert cluster.effects(run.id) == {("a", 1): 1, ("a", 2): 1}
    gate.touch()  # had attempt 1's body outlived the clear, it would now try to commit

    def stopped() -> str:
        lost = [e for e in rejected(cluster.events(run.id)) if e.key == "a" and e.attempt == 1]
        if lost:
            return "fenced: " + "; ".join(f"-> {e.to_state} refused: {e.reason}" for e in lost)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"pool process {pid} ended by the revoke"
        return ""

    print("attempt 1: " + cluster.wait_for(stopped, 60, "attempt 1 stopped", run_id=run.id))
    assert writes(cluster, run.id) == [2]
    assert not [e for e in accepted(cluster.events(run.id), dst="SUCCEEDED") if e.attempt == 1]
    cluster.assert_clean([run.id])


def test_a_body_that_defers_is_refused_and_its_writes_rolled_back(cluster: Cluster) -> None:
    # Given a transactional node whose body raises Defer (it would wait holding no worker)
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS=LEASE)
    cluster.worker("w1", concurrency=1)
    dag = DAG("txn-defer")
    dag.task("a", P + "deferring", max_attempts=3, transactional=True, time_limit=float(LEASE))

    # When it runs, then its attempt fails without a retry and never waits
    run = cluster.orc.submit(dag)
    assert cluster.wait_run(run.id, 60) is RunState.FAILED
    task = cluster.store.reads.get_task(run.id, "a")
    assert task.attempt == 1 and (task.error or "").startswith("TransactionalError: a transactional body cannot Defer")
    assert not [e for e in cluster.events(run.id) if e.to_state == "WAITING"]
    cluster.assert_clean([run.id])


def test_a_transactional_map_killed_before_a_child_commits(cluster: Cluster, tmp_path: Path) -> None:
    # Given a transactional map of three children on a worker armed to die before the first
    # child's commit
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS=LEASE, ORCHESTRATOR_WORKER_RECONCILER="0")
    writes_table(cluster)
    marker = tmp_path / "crashed-once"
    crash = {"ORCHESTRATOR_CRASH_AT": "before_transaction_commit", "ORCHESTRATOR_CRASH_MARKER": str(marker)}
    cluster.worker("w1", concurrency=2, env=crash)
    cluster.reconciler()
    dag = DAG("txn-map")
    dag.map(
        "m", P + "txn_insert", over=[1, 2, 3], kwarg="item", max_attempts=3, backoff=FAST_BACKOFF,
        transactional=True, time_limit=float(LEASE),
    )  # fmt: skip

    # When it runs, one child's pool process is killed between its write and its commit
    run = cluster.orc.submit(dag)
    cluster.wait_for(marker.exists, 60, "a child killed before its commit", run_id=run.id)

    # Then every child's row is there exactly once, of the attempt whose success was accepted
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    with cluster.store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT key, attempt FROM txn_probe.writes WHERE run_id = :run ORDER BY key"), {"run": run.id}
        ).all()
    won = {(e.key, e.attempt) for e in accepted(cluster.events(run.id), dst="SUCCEEDED") if e.key != "m"}
    assert sorted(won) == [tuple(r) for r in rows] and len(rows) == 3, (rows, won)
    retried = [e.key for e in accepted(cluster.events(run.id), src="RUNNING", dst="RETRYING")]
    assert len(retried) == 1, retried
    assert sum(cluster.effects(run.id).values()) == 4, "four executions, three rows"
    children = [t for t in cluster.store.reads.get_tasks(run.id) if t.key != "m"]
    assert sorted(t.result["item"] for t in children) == [1, 2, 3]
    cluster.assert_clean([run.id])
