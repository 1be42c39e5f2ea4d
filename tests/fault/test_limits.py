"""Pools, rate limits, run and DAG limits with real workers: the limits hold on Redis and on
RabbitMQ, across several workers, and their slots come back after a kill -9 (with the lease)
and at once after a cancel. Every figure is read from the database's ledger."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store import schema as s
from tests.fault.harness import Cluster, P

pytestmark = pytest.mark.fault
T = TaskState
FLYING = {"QUEUED", "RUNNING"}


def _events(cluster: Cluster, run_ids: list[str], keys: set[str] | None = None) -> list[Any]:
    e = s.events.c
    with cluster.store.engine.connect() as conn:
        found = conn.execute(
            sa.select(e.run_id, e.key, e.from_state, e.to_state, e.at)
            .where(e.run_id.in_(run_ids), e.key.is_not(None), e.accepted.is_(True))
            .order_by(e.at, e.id)
        ).all()
    return [r for r in found if keys is None or r.key in keys]


def most_at_once(events: list[Any], states: set[str]) -> int:
    """The most tasks in ``states`` at once, replaying the accepted transitions in order."""
    now = most = 0
    for r in events:
        now += (r.to_state in states) - (r.from_state in states)
        most = max(most, now)
    return most


def test_a_pool_never_holds_more_than_its_slots(cluster: Cluster, broker: str) -> None:
    """A pool of 2 slots under 50 tasks on two workers with 4 slots between them: never more
    than 2 of its tasks QUEUED or RUNNING at once, and 2 running at once most of the time."""
    cluster.configure(ORCHESTRATOR_BROKER_URL=broker)
    cluster.orc.limits.set_pool("pair", 2)
    a, b = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
    cluster.wait_ready(a, b)
    dag = DAG("pooled")
    for i in range(50):
        dag.task(f"p{i:02d}", P + "sleep", kwargs={"seconds": 0.05}, pool="pair")
    dag.task("free", P + "noop")
    run = cluster.orc.submit(dag)
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    pooled = {f"p{i:02d}" for i in range(50)}
    events = _events(cluster, [run.id], pooled)
    assert most_at_once(events, FLYING) == 2
    assert most_at_once(events, {"RUNNING"}) == 2
    cluster.assert_clean([run.id])


def test_a_rate_limit_holds_across_two_workers(cluster: Cluster, broker: str) -> None:
    """10/s with a burst of 2, 20 tasks, two workers: in any stretch of d seconds at most
    2 + 10 d admissions (one more for the ledger's clock: an event is stamped with its
    transaction's start), and the tasks ran on both workers."""
    cluster.configure(ORCHESTRATOR_BROKER_URL=broker)
    cluster.orc.limits.set_rate_limit("api", "10/s", burst=2)
    a, b = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
    cluster.wait_ready(a, b)
    dag = DAG("calls")
    for i in range(20):
        dag.task(f"c{i:02d}", P + "sleep", kwargs={"seconds": 0.05}, rate_limit="api")
    run = cluster.orc.submit(dag)
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    admitted = [r.at for r in _events(cluster, [run.id]) if r.to_state == "QUEUED"]
    assert len(admitted) == 20
    for i in range(len(admitted)):
        for j in range(i, len(admitted)):
            span = (admitted[j] - admitted[i]).total_seconds()
            assert j - i + 1 <= 2 + 10 * span + 1, (i, j, span)
    assert (admitted[-1] - admitted[0]).total_seconds() >= 1.6  # 18 tokens at 10/s after the burst
    with cluster.store.engine.connect() as conn:
        workers = set(conn.execute(sa.select(s.tasks.c.worker).where(s.tasks.c.run_id == run.id)).scalars())
    assert {w.split("@")[0] for w in workers} == {"w1", "w2"}
    cluster.assert_clean([run.id])


def test_run_and_dag_limits_hold_with_real_workers(cluster: Cluster) -> None:
    """max_active_tasks=2 on a run, a limit of 3 on its DAG across two runs, 8 worker slots."""
    cluster.orc.limits.set_dag_limit("capped", 3)
    w = cluster.worker("w1", concurrency=4)
    runs = []
    for _ in range(2):
        dag = DAG("capped", max_active_tasks=2)
        for i in range(10):
            dag.task(f"k{i}", P + "sleep", kwargs={"seconds": 0.05})
        runs.append(cluster.orc.submit(dag).id)
    for run_id in runs:
        assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
    for run_id in runs:
        assert most_at_once(_events(cluster, [run_id]), FLYING) == 2
    assert most_at_once(_events(cluster, runs), FLYING) == 3
    assert w.popen.poll() is None
    cluster.assert_clean(runs)


def _first_claim_after(cluster: Cluster, run_id: str, after: Any, worker: str) -> Any:
    e = s.events.c
    with cluster.store.engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.min(e.at)).where(
                e.run_id == run_id,
                e.to_state == "RUNNING",
                e.accepted.is_(True),
                e.at > after,
                e.reason.like(f"claim by {worker}%"),
            )
        ).scalar()


def _ledger(cluster: Cluster, run_id: str) -> list[Any]:
    """The run's accepted task transitions, with their actors."""
    e = s.events.c
    with cluster.store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(e.key, e.from_state, e.to_state, e.actor, e.at)
                .where(e.run_id == run_id, e.key.is_not(None), e.accepted.is_(True))
                .order_by(e.id)
            ).all()
        )


def _db_now(cluster: Cluster) -> Any:
    with cluster.store.engine.connect() as conn:
        return conn.execute(sa.text("select clock_timestamp()")).scalar_one()


def test_pool_slots_of_a_killed_worker_come_back_with_the_lease(cluster: Cluster) -> None:
    """A worker holding every slot of a pool is killed with -9: its attempts' leases lapse, the
    reconciler retries them, and another worker runs them: the slots are back within the
    lease (2 s here) and a tick (0.3 s), plus the hand-off."""
    cluster.orc.limits.set_pool("solo", 2)
    w1 = cluster.worker("w1", concurrency=2)
    dag = DAG("held")
    # (a first attempt sleeps 30 s, a retry returns at once: the two held when w1 dies still run
    # then, however long a loaded machine takes to start w2)
    for i in range(4):
        dag.task(f"h{i}", "tasks.dynamic.gated", kwargs={"first_seconds": 30.0}, pool="solo", max_attempts=3)
    run = cluster.orc.submit(dag)
    cluster.wait_for(
        lambda: sum(t.state is T.RUNNING for t in cluster.orc.run(run.id).tasks()) == 2, 30, "both slots running"
    )
    w2 = cluster.worker("w2", concurrency=2)  # idle: the pool is full
    killed_at = _db_now(cluster)
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    claimed = cluster.wait_for(lambda: _first_claim_after(cluster, run.id, killed_at, "w2@fault"), 60, "w2 claims")
    back = (claimed - killed_at).total_seconds()
    print(f"pool slots back {back:.2f}s after kill -9 (lease 2 s, tick 0.3 s)")
    # the slots came back with the leases: the reconciler expired a lease of w1 before w2's first
    # claim (by the ledger, not by how fast a loaded machine got there)
    expired = [e for e in _ledger(cluster, run.id) if (e.from_state, e.to_state, e.actor) == ("RUNNING", "RETRYING",
               "reconciler")]  # fmt: skip
    assert expired and min(e.at for e in expired) <= claimed, (expired, claimed)
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert most_at_once(_events(cluster, [run.id]), {"RUNNING"}) <= 2 + 2  # the dead ones until their lease lapsed
    assert w2.popen.poll() is None
    # w1's messages stay unacked in Redis until the visibility timeout; restored now (what a
    # live worker does then), they reach w2, whose claim refuses the stale attempts
    assert cluster.restore_unacked() >= 1
    cluster.assert_clean([run.id])


def test_a_cancelled_run_frees_its_pool_slots_at_once(cluster: Cluster) -> None:
    # (no reconciler anywhere, the worker's off too: only the cancel's own admission can hand
    # the slot on, so that it did is read from the ledger, not from how soon on this machine)
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0")
    cluster.orc.limits.set_pool("one", 1)
    cluster.worker("w1", concurrency=2)
    holder = DAG("holder")
    holder.task("long", P + "sleep", kwargs={"seconds": 30.0}, pool="one")
    a = cluster.orc.submit(holder)
    cluster.wait_task(a.id, "long", lambda t: t.state is T.RUNNING, 30, "the holder running")
    waiter = DAG("waiter")
    waiter.task("next", P + "noop", pool="one")
    b = cluster.orc.submit(waiter)
    out = cluster.cli("explain", b.id, "--json")
    assert out.returncode == 0, out.stderr
    (task,) = json.loads(out.stdout)["tasks"]
    (reason,) = task["reasons"]
    assert reason["kind"] == "pool_full" and reason["held_by"] == {f"{a.id}/long": 1}, reason
    before = _db_now(cluster)
    assert cluster.orc.cancel(a.id) == 1
    started = cluster.wait_for(lambda: _first_claim_after(cluster, b.id, before, "w1@fault"), 60, "claim")
    (cancelled,) = [e for e in cluster.run_events(a.id) if e.to_state == "CANCELLED" and e.accepted]
    took = (started - cancelled.at).total_seconds()
    (queued,) = [e for e in cluster.events(b.id) if e.to_state == "QUEUED" and e.accepted]
    print(
        f"pool slot reused {took * 1000:.0f} ms after the cancel's commit"
        f" (admitted after {(queued.at - cancelled.at).total_seconds() * 1000:.0f} ms)"
    )
    assert queued.at >= cancelled.at and took >= 0, took
    assert cluster.wait_run(b.id, 60) is RunState.SUCCEEDED
    cluster.assert_clean([b.id])
