"""A deep backlog behind few worker slots is never mistaken for lost dispatches.

Admission is bounded by live worker capacity times the dispatch depth, so the broker holds at
most a few messages per slot; the backlog waits in the database as READY rows. A message
waiting behind busy slots past the dispatch timeout is not lost either: the reconciler
re-publishes a QUEUED task only when a later message of its queue already runs or a slot that
could take it is idle.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState
from orchestrator.store import schema as s
from tests.fault.harness import Cluster, P, republished

pytestmark = pytest.mark.fault


def _backlog(cluster: Cluster, n: int, timeout: float) -> None:
    # Given two single-slot workers, a reconciler and a short dispatch timeout
    cluster.configure(ORCHESTRATOR_DISPATCH_TIMEOUT="2")
    w1, w2 = cluster.start_worker("w1", concurrency=1), cluster.start_worker("w2", concurrency=1)
    cluster.wait_ready(w1, w2)
    cluster.reconciler()

    # When a run of n independent tasks is submitted at once
    dag = DAG(f"backlog-{n}")
    for i in range(n):
        dag.task(f"t{i}", P + "noop")
    started = time.monotonic()
    run = cluster.orc.submit(dag)

    # Then at most the live capacity is ever in flight, the rest waits as READY rows ...
    peak = 0
    while cluster.store.reads.run_state(run.id) is RunState.RUNNING:
        with cluster.store.engine.connect() as conn:
            inflight = conn.execute(
                sa.select(sa.func.count()).where(s.tasks.c.run_id == run.id, s.tasks.c.state.in_(["QUEUED", "RUNNING"]))
            ).scalar_one()
        peak = max(peak, inflight)
        if time.monotonic() - started > timeout:
            pytest.fail(f"backlog of {n} not done after {timeout}s: {cluster.store.reads.get_run(run.id).counts}")
        time.sleep(0.5)
    assert cluster.store.reads.get_run(run.id).state is RunState.SUCCEEDED
    depth = cluster.settings.dispatch_depth
    assert peak <= 2 * depth, f"{peak} tasks in flight for 2 worker slots at depth {depth}"
    # ... and not one task was re-published as lost: zero accepted QUEUED -> QUEUED events
    events = cluster.events(run.id)
    assert republished(events) == {}
    assert not [e for e in events if not e.accepted], "no conflict at all: nothing raced"
    assert all(e.attempt == 1 for e in events)
    cluster.assert_clean([run.id])


def test_backlog_behind_two_workers_is_not_republished(cluster: Cluster) -> None:
    _backlog(cluster, 1_500, timeout=150)


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_ten_thousand_task_backlog_is_not_republished(cluster: Cluster) -> None:
    _backlog(cluster, 10_000, timeout=900)


def test_messages_waiting_behind_long_tasks_are_not_republished(cluster: Cluster) -> None:
    # Given two single-slot workers, a dispatch depth of 3 (two messages wait in the broker
    # behind each running task) and a dispatch timeout shorter than the wait
    cluster.configure(ORCHESTRATOR_DISPATCH_TIMEOUT="1.5", ORCHESTRATOR_DISPATCH_DEPTH="3")
    w1, w2 = cluster.start_worker("w1", concurrency=1), cluster.start_worker("w2", concurrency=1)
    cluster.wait_ready(w1, w2)
    cluster.reconciler()

    # When ten 1.2 s tasks are submitted at once
    dag = DAG("deep-queue")
    for i in range(10):
        dag.task(f"t{i}", P + "sleep", kwargs={"seconds": 1.2})
    run = cluster.orc.submit(dag)
    assert len(cluster.store.reads.get_run(run.id).counts) >= 1

    # Then six are in flight at once (two running, four waiting in the broker for ~2.4 s,
    # past the dispatch timeout), and still none is re-published as lost
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    events = cluster.events(run.id)
    assert republished(events) == {}
    waited = [
        (t.started_at - t.dispatched_at).total_seconds()
        for t in cluster.store.reads.get_tasks(run.id)
        if t.started_at and t.dispatched_at
    ]
    assert max(waited) > 1.5, f"no message waited past the dispatch timeout: {waited}"
    cluster.assert_clean([run.id])
