"""Message faults: a dispatch committed but never published, a result committed but never
acked, the same message delivered twice at once, two reconcilers racing on a lost backlog."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import (
    Cluster,
    P,
    accepted,
    rejected,
    republished,
    republished_once_per_timeout,
    write_spec,
)

pytestmark = pytest.mark.fault
T = TaskState


def _crash_submit(cluster: Cluster, dag: DAG, tmp_path: Path) -> str:
    """``orchestrator submit`` killed between the dispatch commit and the publish; the run id."""
    done = cluster.cli(
        "submit", str(write_spec(dag, tmp_path / "spec.json")), ORCHESTRATOR_CRASH_AT="after_dispatch_commit"
    )
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "", "it died before printing the run id"
    runs = cluster.store.reads.list_runs(10)
    assert len(runs) == 1
    return runs[0].id


def test_crash_between_dispatch_commit_and_publish(cluster: Cluster, tmp_path: Path) -> None:
    # Given a live worker (its capacity admits the roots) and no reconciler yet (the worker's
    # own is off: a pass of it could admit the roots before the submit does)
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0")
    cluster.worker("w1", concurrency=2)
    dag = DAG("lost-dispatch")
    a = dag.task("a", P + "echo", kwargs={"n": 1})
    b = dag.task("b", P + "echo", kwargs={"n": 2})
    dag.task("c", P + "echo", upstream=[a, b])

    # When the submitting process dies after committing the dispatch, before publishing
    run_id = _crash_submit(cluster, dag, tmp_path)

    # Then the roots are QUEUED in the database with no message anywhere in the broker
    states = {t.key: t.state for t in cluster.store.reads.get_tasks(run_id)}
    assert states == {"a": T.QUEUED, "b": T.QUEUED, "c": T.PENDING}
    assert not any(cluster.broker_backlog().values()), cluster.broker_backlog()
    # And once a reconciler runs, it re-publishes each lost root after the dispatch timeout
    # (once per lapse of it: the worker's slots are idle, so the messages were really lost)
    cluster.reconciler()
    assert cluster.wait_run(run_id, 60) is RunState.SUCCEEDED
    events = cluster.events(run_id)
    assert set(republished_once_per_timeout(events, cluster.settings.dispatch_timeout)) == {("a", 1), ("b", 1)}
    assert all(t.attempt == 1 for t in cluster.store.reads.get_tasks(run_id))
    assert set(cluster.store.reads.get_task(run_id, "c").result["upstream"]) == {"a", "b"}
    cluster.assert_clean([run_id])


def test_crash_between_result_commit_and_ack(cluster: Cluster, tmp_path: Path) -> None:
    # Given a worker armed to die right after the first result commit (and only the first)
    marker = tmp_path / "crashed-once"
    w1 = cluster.worker(
        "w1",
        concurrency=2,
        env={"ORCHESTRATOR_CRASH_AT": "after_result_commit", "ORCHESTRATOR_CRASH_MARKER": str(marker)},
    )
    cluster.reconciler()
    dag = DAG("lost-ack")
    a = dag.task("a", P + "echo", kwargs={"n": 1}, max_attempts=3)
    dag.task("b", P + "echo", upstream=[a], max_attempts=3)

    # When "a" commits SUCCEEDED and its pool process dies before the ack (and before publishing b)
    run = cluster.orc.submit(dag)

    # Then Celery requeues a's message, the redelivery is refused by the claim CAS and dropped,
    # b's lost dispatch is re-published by the reconciler, and a was committed exactly once
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert marker.exists()
    # (the pool notices the lost child within worker_lost_wait, 10 s by default)
    cluster.wait_for(lambda: "exited with 'signal 9 (SIGKILL)'" in w1.text(), 20, "the lost child", run_id=run.id)
    cluster.wait_for(
        lambda: rejected(cluster.events(run.id), dst="RUNNING", actor="worker"),
        20,
        "the redelivered message of a to be refused",
        run_id=run.id,
    )
    events = cluster.events(run.id)
    assert [(e.key, e.attempt) for e in accepted(events, dst="SUCCEEDED")] == [("a", 1), ("b", 1)]
    assert [(e.key, e.attempt) for e in rejected(events, dst="RUNNING")] == [("a", 1)]
    assert cluster.effects(run.id) == {("a", 1): 1, ("b", 1): 1}, "the redelivery never ran the body"
    assert set(republished_once_per_timeout(events, cluster.settings.dispatch_timeout)) == {("b", 1)}
    assert cluster.store.reads.get_task(run.id, "a").attempt == 1
    cluster.assert_clean([run.id])


@pytest.mark.parametrize("claim_delay", ["0", "0.2"])
def test_same_message_delivered_twice_at_once(cluster: Cluster, claim_delay: str) -> None:
    # Given two idle single-slot workers (claiming before the body, or a direct message's body
    # first for 0.2 s), and a task admitted (QUEUED) but not yet published. The workers' own
    # reconciler is off and the dispatch timeout long: a pass of a worker's reconciler admitted
    # x before the test did on a loaded machine, and one that re-published x because its
    # deliveries came late would add a third copy
    cluster.configure(
        ORCHESTRATOR_CLAIM_DELAY=claim_delay, ORCHESTRATOR_WORKER_RECONCILER="0", ORCHESTRATOR_DISPATCH_TIMEOUT="300"
    )
    a, b = cluster.start_worker("wa", concurrency=1), cluster.start_worker("wb", concurrency=1)
    cluster.wait_ready(a, b)
    dag = DAG("double")
    x = dag.task("x", P + "sleep", kwargs={"seconds": 3.0})
    dag.task("z", P + "echo", upstream=[x])
    orc = cluster.orc
    queues = {k: "orchestrator.default" for k in dag.nodes}
    run_id, _ = orc.store.submission.create_run(dag, queues=queues, wants_upstream=orc.registry.wants_upstream)
    dispatches = orc.store.admission.admit_ready(orc.settings.dispatch_window)
    assert [(d.key, d.attempt) for d in dispatches] == [("x", 1)]

    # When its (run, key, attempt) message is published twice right away: same task id and
    # orchestrator headers, so each idle worker takes one copy at the same moment
    assert orc.publisher.publish(dispatches + dispatches) == 2

    # Then both workers received it, one claim won and ran the body, the other claim was
    # refused, recorded as rejected, and dropped (a direct body ran on both until its claim
    # delay was up: the loser's was stopped there). The loser is refused while the winner holds
    # the row RUNNING (3 s), or after it finished when a loaded machine delivered its copy late:
    # a refusal either way, the row's state when it came is timing, not contract
    cluster.reconciler()
    assert cluster.wait_run(run_id, 60) is RunState.SUCCEEDED
    refused = cluster.wait_for(
        lambda: rejected(cluster.events(run_id), dst="RUNNING", actor="worker"), 60, "the loser's refused claim",
        run_id=run_id,
    )  # fmt: skip
    task_id = f"{run_id}.x.1] received"
    cluster.wait_for(lambda: task_id in a.text() and task_id in b.text(), 60, "both deliveries", run_id=run_id)
    events = cluster.events(run_id)
    assert [e.key for e in accepted(events, src="QUEUED", dst="RUNNING")] == ["x", "z"]
    assert [(e.key, e.attempt) for e in accepted(events, dst="SUCCEEDED")] == [("x", 1), ("z", 1)]
    assert [(e.key, e.attempt) for e in refused] == [("x", 1)]
    assert refused[0].from_state in ("RUNNING", "SUCCEEDED"), refused[0].from_state
    print(f"the loser's claim was refused while x was {refused[0].from_state}")
    assert cluster.effects(run_id) == {("x", 1): 1 if claim_delay == "0" else 2, ("z", 1): 1}
    assert republished(events) == {}
    cluster.assert_clean([run_id])


def test_two_reconcilers_republish_each_lost_task_once(cluster: Cluster, tmp_path: Path) -> None:
    # Given a stale QUEUED backlog: a submit that died after its dispatch commit, on 4 free slots
    # (depth 1: one message per slot, so 4 of the 8 roots are admitted; the worker's own
    # reconciler is off, so only the two below reconcile)
    cluster.configure(ORCHESTRATOR_DISPATCH_DEPTH="1", ORCHESTRATOR_WORKER_RECONCILER="0")
    cluster.worker("w1", concurrency=4)
    dag = DAG("two-reconcilers")
    roots = [dag.task(f"r{i}", P + "noop") for i in range(8)]
    dag.task("sink", P + "echo", upstream=roots)
    run_id = _crash_submit(cluster, dag, tmp_path)
    lost = {t.key for t in cluster.store.reads.get_tasks(run_id) if t.state is T.QUEUED}
    assert len(lost) == 4

    # When two reconcile services run at once: one holds the duty at a time (the race of two
    # passes on one row is the store's contract test test_stale_dispatch_is_republished_once)
    cluster.reconciler("reconciler-1", interval=0.05)
    cluster.reconciler("reconciler-2", interval=0.05)

    # Then each lost task is re-published once for its attempt (for each lapse of the dispatch
    # timeout: a loaded machine's worker may take longer than one to claim it)
    assert cluster.wait_run(run_id, 60) is RunState.SUCCEEDED
    events = cluster.events(run_id)
    assert set(republished_once_per_timeout(events, cluster.settings.dispatch_timeout)) == {(k, 1) for k in lost}
    assert all(e.attempt == 1 for e in events)
    assert len(accepted(events, dst="SUCCEEDED")) == 9
    # when both loops saw the same stale row, the loser of the redispatch CAS is in the ledger
    # (usually 3 of the 4 rows; not asserted: the overlap of two loops is timing, not contract)
    lost_races = rejected(events, dst="QUEUED", actor="reconciler")
    assert all(e.key in lost and e.attempt == 1 for e in lost_races), lost_races
    cluster.assert_clean([run_id])


def test_a_direct_body_whose_claim_cannot_be_written_goes_back_to_its_queue(cluster: Cluster) -> None:
    """A direct message's body runs before its claim; when the claim (folded into its success)
    cannot be written - the database unreachable past the retries - the message is requeued,
    not acknowledged: it comes back redelivered (counted in ``orc_deliveries``, the record of
    that execution), claims first and runs again. Before, it was acked and only the
    reconciler's re-publish (or a duplicate copy, with no record at all) ran it again."""
    import sqlalchemy as sa

    from orchestrator.testing.chaos import Relays

    relays = Relays()
    try:
        url = sa.engine.make_url(cluster.database_url)
        relay = relays.add("pg", (url.host or "127.0.0.1", url.port or 5432))
        relayed = url.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
        # Given a worker whose bodies of direct messages run up to 10 s before their claim, on a
        # database connection through a relay (leases of 2 s: an outcome is retried for 2 s), and
        # a reconciler that re-publishes a QUEUED task only after a minute (the redelivery, not a
        # re-publish, is what must bring x back)
        cluster.configure(ORCHESTRATOR_CLAIM_DELAY="10", ORCHESTRATOR_DISPATCH_TIMEOUT="60")
        w = cluster.start_worker("direct", concurrency=1, env={"ORCHESTRATOR_DATABASE_URL": relayed})
        cluster.wait_ready(w)
        dag = DAG("direct-unwritten")
        x = dag.task("x", P + "sleep", kwargs={"seconds": 3.0})
        dag.task("z", P + "echo", upstream=[x])
        run = cluster.orc.submit(dag)
        # When the database is cut off from the worker while x's 3 s body runs, until well after
        # the body ended and the worker's retries of its outcome (2 s) gave up
        cluster.wait_for(lambda: cluster.effects(run.id)[("x", 1)] >= 1, 30, "x's body started", run_id=run.id)
        assert cluster.store.reads.get_task(run.id, "x").state is T.QUEUED  # unclaimed
        relays.cut(relay)
        # (until the worker gave its outcome up and requeued the message: its log says so; a
        # fixed cut of 7 s was too short for a 3 s body on a loaded machine)
        cluster.wait_for(
            lambda: "could not be written; its message goes back to its queue" in w.text(), 60,
            "the worker to give the unwritten claim up", run_id=None,
        )  # fmt: skip
        relays.reopen(relay)
        # Then the run succeeds; x ran twice, the second time claimed first after a counted
        # redelivery, and the reconciler re-published nothing
        assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED, w.tail()
        assert cluster.effects(run.id)[("x", 1)] == 2
        assert "could not be written; its message goes back to its queue" in w.text()
        events = cluster.events(run.id)
        assert republished(events) == {}
        with cluster.store.engine.connect() as conn:
            counted = conn.execute(
                sa.text("SELECT deliveries FROM orc_deliveries WHERE message_id = :m"), {"m": f"{run.id}.x.1"}
            ).scalar()
        assert counted == 2
        cluster.assert_clean([run.id])
    finally:
        cluster.close()
        relays.close()
