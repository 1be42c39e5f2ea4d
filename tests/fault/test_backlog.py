"""A deep backlog behind few worker slots is never mistaken for lost dispatches.

Admission is bounded by live worker capacity, so every published message has a free slot
waiting for it: a QUEUED task that stays unclaimed past the dispatch timeout was really lost.
A backlog far larger than the capacity must therefore wait in the database as READY rows and
never be re-published by the reconciler.
"""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState
from orchestrator import schema as s
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
    assert peak <= 2, f"{peak} tasks in flight for 2 worker slots"
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
