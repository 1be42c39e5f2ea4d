"""Deadlines with real workers: a slow task past a short deadline gets its miss recorded, once,
by the workers' own reconciler (no `orchestrator reconcile`), and alerted to the webhook; with
``on_deadline="cancel"`` the run ends CANCELLED and its running attempt is stopped."""

from __future__ import annotations

import pytest

from orchestrator import DAG, RunState, TaskState
from orchestrator.core.states import DEADLINE_MISSED
from tests.fault.harness import Cluster, P, accepted, webhook

pytestmark = pytest.mark.fault
T = TaskState


def deadline_events(cluster: Cluster, run_id: str) -> list[tuple[str | None, str, str, bool]]:
    """The run's ``deadline_missed`` ledger rows: (key, state, actor, accepted)."""
    return [
        (e.key, e.to_state, e.actor, e.accepted)
        for e in cluster.store.reads.snapshot([run_id]).events
        if e.kind == DEADLINE_MISSED
    ]


def test_a_slow_run_misses_its_deadline_once_and_goes_on(cluster: Cluster) -> None:
    with webhook() as hook:
        # Given two workers (their reconcilers compete for the duty) that POST alerts to a webhook
        cluster.configure(ORCHESTRATOR_ALERT_WEBHOOK=hook.url)
        w1, w2 = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
        cluster.wait_ready(w1, w2)

        # When a run with a 1.5 s deadline has a 12 s task that must be done after 1 s (12 s: the
        # misses must come while it runs, also when a loaded machine's reconciler passes are late)
        dag = DAG("slow-deadline", deadline=1.5)
        nap = dag.task("nap", P + "sleep", kwargs={"seconds": 12}, deadline=1)
        dag.task("after", P + "echo", upstream=[nap], deadline=3600)
        run = cluster.orc.submit(dag)

        # Then both misses are recorded by a worker's reconciler while the task still runs,
        # and alerted; the run is not stopped
        cluster.wait_for(lambda: len(deadline_events(cluster, run.id)) == 2, 10, "two misses", run_id=run.id)
        assert cluster.store.reads.get_task(run.id, "nap").state is T.RUNNING
        assert cluster.wait_run(run.id, 30) is RunState.SUCCEEDED
        assert sorted(deadline_events(cluster, run.id), key=lambda e: e[0] or "") == [
            (None, "RUNNING", "reconciler", True),
            ("nap", "RUNNING", "reconciler", True),
        ]
        cluster.wait_for(lambda: len(hook.received) >= 2, 10, "two webhook alerts", run_id=run.id)
        by_key = {a["key"]: a for a in hook.received}
        assert len(hook.received) == 2 and set(by_key) == {None, "nap"}
        for key, seconds in ((None, 1.5), ("nap", 1.0)):
            a = by_key[key]
            assert (a["event"], a["run_id"], a["dag"], a["tenant"]) == (
                "deadline_missed",
                run.id,
                "slow-deadline",
                "default",
            )
            assert (a["deadline_seconds"], a["on_deadline"], a["state"]) == (seconds, "alert", "RUNNING")
        assert by_key["nap"]["reason"].startswith("deadline missed: task 'nap' deadline 1s (due ")
        # "after" ended long before its deadline: judged met once that falls due, never missed
        assert cluster.store.deadlines.count() == {"run": 1, "task": 1}

    cluster.assert_clean([run.id])


def test_on_deadline_cancel_cancels_the_run_with_real_workers(cluster: Cluster) -> None:
    # Given a worker, and a run with on_deadline="cancel" whose task sleeps far past the deadline
    cluster.worker("w1", concurrency=2)
    dag = DAG("cancel-on-deadline", deadline=1.5, on_deadline="cancel")
    nap = dag.task("nap", P + "sleep", kwargs={"seconds": 60})
    dag.task("after", P + "echo", upstream=[nap])
    run = cluster.orc.submit(dag)
    cluster.wait_task(run.id, "nap", lambda t: t.state is T.RUNNING, 30, "nap running")

    # When the deadline passes, then the worker's reconciler cancels the run, and records the miss
    assert cluster.wait_run(run.id, 15) is RunState.CANCELLED
    # (a cancel closes the run's row first, then its open tasks in batches: wait for those too)
    cancelled = {"nap": T.CANCELLED, "after": T.CANCELLED}
    cluster.wait_for(
        lambda: {t.key: t.state for t in cluster.store.reads.get_tasks(run.id)} == cancelled,
        15,
        "the run's tasks cancelled",
        run_id=run.id,
    )
    run_events = cluster.run_events(run.id)
    cancelled = accepted(run_events, src="RUNNING", dst="CANCELLED")
    assert [e.actor for e in cancelled] == ["reconciler"]
    cluster.wait_for(lambda: deadline_events(cluster, run.id), 5, "the miss recorded", run_id=run.id)
    assert deadline_events(cluster, run.id) == [(None, "CANCELLED", "reconciler", True)]
    [miss] = cluster.store.deadlines.misses(run.id)
    assert "on_deadline=cancel: the run is CANCELLED" in miss.reason and "it was RUNNING" in miss.reason
    # the running attempt was revoked: its body stops (the pool process is terminated, or its
    # heartbeat loses the lease), nothing more is committed, and the broker drains
    cluster.assert_clean([run.id])
    assert cluster.store.reads.get_task(run.id, "nap").result is None
