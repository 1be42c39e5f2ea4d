"""Worker faults: a pool child or a whole worker SIGKILLed, a worker paused past its lease,
a worker whose clock is skewed."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store import schema as s
from tests.fault.harness import (
    Cluster,
    P,
    accepted,
    log_clock_offset,
    rejected,
    worker_pid,
)

pytestmark = pytest.mark.fault
T = TaskState
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}
#: how long a victim's body runs: long enough that it still runs when a loaded machine's test
#: gets to kill it (3 s ended before the kill there)
VICTIM_SECONDS = 8.0


def _victim_dag(name: str, seconds: float) -> DAG:
    dag = DAG(name)
    victim = dag.task("victim", P + "sleep", kwargs={"seconds": seconds}, max_attempts=3, backoff=FAST_BACKOFF)
    dag.task("after", P + "echo", kwargs={"x": 1}, upstream=[victim])
    dag.task("bystander", P + "sleep", kwargs={"seconds": 0.5}, max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def test_pool_child_killed_mid_task(cluster: Cluster) -> None:
    # Given a prefork worker, a reconciler, and a run whose task "victim" is running
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(_victim_dag("kill-child", VICTIM_SECONDS))
    victim = cluster.wait_task(run.id, "victim", lambda t: t.state is T.RUNNING, 30, "victim running")
    pid = worker_pid(victim)
    assert pid != w1.pid and os.getpgid(pid) == w1.pid, "the worker column names a pool child of w1"
    # the body itself has started (RUNNING is committed by the claim, a moment before the body)
    cluster.wait_for(lambda: cluster.effects(run.id)[("victim", 1)] == 1, 10, "the victim's body started")

    # When the pool child running it is SIGKILLed
    os.kill(pid, signal.SIGKILL)

    # Then its lease expires, the attempt counts as failed, attempt 2 runs, and the run succeeds
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    task = cluster.store.reads.get_task(run.id, "victim")
    assert task.state is T.SUCCEEDED and task.attempt == 2 and task.result == VICTIM_SECONDS
    events = cluster.events(run.id)
    expired = accepted(events, src="RUNNING", dst="RETRYING", actor="reconciler")
    assert [(e.key, e.attempt) for e in expired] == [("victim", 1)]
    assert cluster.effects(run.id)[("victim", 1)] == 1 and cluster.effects(run.id)[("victim", 2)] == 1
    # the message Celery requeued for the lost child (reject_on_worker_lost) is redelivered and dropped
    cluster.wait_for(
        lambda: rejected(cluster.events(run.id), dst="RUNNING", actor="worker"),
        20,
        "the redelivered attempt-1 message to be refused by the claim CAS",
        run_id=run.id,
    )
    assert {e.attempt for e in rejected(cluster.events(run.id), dst="RUNNING")} == {1}
    assert w1.popen.poll() is None, "the worker itself survived and replaced its child"
    cluster.assert_clean([run.id])


def test_worker_main_process_killed(cluster: Cluster) -> None:
    # Given a worker running "victim" and a reconciler
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(_victim_dag("kill-worker", VICTIM_SECONDS))
    cluster.wait_task(run.id, "victim", lambda t: t.state is T.RUNNING, 30, "victim running")

    # When the worker's main process and its children are SIGKILLed, and a new worker starts
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.worker("w2", concurrency=2)

    # Then the lost attempt expires with its lease and the run completes on the new worker
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    task = cluster.store.reads.get_task(run.id, "victim")
    assert task.state is T.SUCCEEDED and task.attempt == 2 and task.worker.startswith("w2@fault:")
    events = cluster.events(run.id)
    expired = accepted(events, src="RUNNING", dst="RETRYING", actor="reconciler")
    # (whatever else w1 was running when it died expired too)
    assert ("victim", 1) in {(e.key, e.attempt) for e in expired}
    assert {e.attempt for e in expired} == {1}
    # And the messages w1 had taken stay unacked in Redis until kombu's visibility timeout
    # restores them; restoring them now (what a live worker does after the timeout) redelivers
    # them to w2, which drops them: the claim CAS refuses a stale attempt
    assert cluster.redis.zcard("unacked_index") >= 1
    restored = cluster.restore_unacked()
    assert restored >= 1
    cluster.wait_for(
        lambda: rejected(cluster.events(run.id), dst="RUNNING", actor="worker"),
        20,
        "the stale attempt-1 redelivery to be refused",
        run_id=run.id,
    )
    cluster.assert_clean([run.id])


def test_paused_worker_result_is_rejected(cluster: Cluster) -> None:
    # Given two single-slot workers and a task running on one of them
    a, b = cluster.start_worker("wa", concurrency=1), cluster.start_worker("wb", concurrency=1)
    cluster.wait_ready(a, b)
    cluster.reconciler()
    dag = DAG("pause")
    # (10 s: long enough that it still runs when a loaded machine's test gets to pause it)
    dag.task("slow", P + "sleep", kwargs={"seconds": 10}, max_attempts=3, backoff=FAST_BACKOFF)
    run = cluster.orc.submit(dag)
    first = cluster.wait_task(run.id, "slow", lambda t: t.state is T.RUNNING, 30, "slow running")
    paused, other = (a, b) if first.worker.startswith("wa@") else (b, a)

    # When that worker (main process and pool children) is SIGSTOPped past its lease
    paused.signal_group(signal.SIGSTOP)
    second = cluster.wait_task(
        run.id, "slow", lambda t: t.attempt == 2 and t.state is T.RUNNING, 30, "attempt 2 running elsewhere"
    )
    assert second.worker.startswith(f"{other.name}@fault:")
    # ... and resumed while attempt 2 runs elsewhere
    paused.signal_group(signal.SIGCONT)

    # Then the paused worker's late outcome for attempt 1 is rejected, attempt 2 is committed once
    cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(run.id), actor="worker") if e.attempt == 1],
        30,
        "the paused worker's late outcome to be rejected",
        run_id=run.id,
    )
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    events = cluster.events(run.id)
    # (a rejected event's from_state is what the row held when the late CAS lost: attempt 2's state)
    late = [e for e in rejected(events, actor="worker") if e.to_state in ("SUCCEEDED", "FAILED", "RETRYING")]
    assert late and {e.attempt for e in late} == {1}, late
    assert all(e.from_state in ("RUNNING", "SUCCEEDED") for e in late), late
    assert [e.attempt for e in accepted(events, dst="SUCCEEDED")] == [2]
    assert [e.attempt for e in accepted(events, src="RUNNING", dst="RETRYING", actor="reconciler")] == [1]
    task = cluster.store.reads.get_task(run.id, "slow")
    assert task.state is T.SUCCEEDED and task.attempt == 2 and task.worker.startswith(f"{other.name}@")
    assert cluster.effects(run.id) == {("slow", 1): 1, ("slow", 2): 1}
    assert paused.popen.poll() is None
    cluster.assert_clean([run.id])


@pytest.mark.parametrize("skew", ["+1h", "-1h"])
def test_skewed_worker_clock_does_not_expire_leases(cluster: Cluster, skew: str) -> None:
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.fail("faketime is required for the clock-skew scenario (apt-get install faketime)")
    # Given a worker whose wall clock is an hour off, and a reconciler on the real clock
    w = cluster.worker("skewed", concurrency=2, prefix=[faketime, "-f", skew])
    offset = log_clock_offset(w.text())
    expected = 3600.0 if skew.startswith("+") else -3600.0
    assert offset is not None and abs(offset - expected) < 120, f"worker clock offset {offset}s, not {skew}"
    cluster.reconciler()

    # When it runs tasks that last two leases each (kept alive by heartbeats only)
    dag = DAG("skew")
    for i in range(2):
        dag.task(f"long{i}", P + "sleep", kwargs={"seconds": 4}, max_attempts=3, backoff=FAST_BACKOFF)
    run = cluster.orc.submit(dag)
    cluster.wait_task(run.id, "long0", lambda t: t.state is T.RUNNING, 30, "long0 running")
    # Then every lease is set from the database clock: it ends within one lease of DB now()
    with cluster.store.engine.connect() as conn:
        remaining = conn.execute(
            sa.select(sa.func.extract("epoch", s.tasks.c.lease_expires_at - sa.func.now())).where(
                s.tasks.c.run_id == run.id, s.tasks.c.state == "RUNNING"
            )
        ).scalars().all()  # fmt: skip
    assert remaining and all(0 < float(x) <= 2.5 for x in remaining), remaining

    # And no lease expires early: both tasks succeed on attempt 1 and no lease-expiry event exists
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert all(t.attempt == 1 and t.worker.startswith("skewed@fault:") for t in cluster.store.reads.get_tasks(run.id))
    events = cluster.events(run.id)
    assert [e for e in events if e.actor == "reconciler"] == [], "no lease expiry, accepted or rejected"
    assert "lease lost" not in w.text()
    cluster.assert_clean([run.id])
