"""Child runs (``DAG.run_dag``, issue 34) on real workers: one child run per parent attempt, and one
result, under a kill -9 and duplicates; the parent-end policies under a cancel and a clear.

* The reconciler that starts a child is SIGKILLed right after the child's commit (crash point
  ``after_child_commit``: stored and linked, nothing published); the start is repeated for the
  same attempt from another process; the child's first task's message is delivered twice at once.
* The worker running the child's task is SIGKILLed mid-body: the child's task is retried, the
  child succeeds once, the parent node ends once with its result.
* Cancel and clear of the parent with ``on_parent_end="cancel"`` and ``"abandon"``.

Each scenario is checked from the database: the child runs of each (parent run, key, attempt),
the node's accepted outcomes, the probes' executions, ``check_runs`` and an empty broker.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store import rows
from orchestrator.store import schema as s
from orchestrator.store.children import Pending
from tests.fault.harness import Cluster, P, accepted, rejected

pytestmark = pytest.mark.fault
T = TaskState
FAST = {"base": 0.2, "cap": 0.5}


def parent_dag(name: str, seconds: float, *, policy: str = "cancel") -> DAG:
    """a -> kid (a child run: x sleeps ``seconds`` -> y echoes) -> b."""
    child = DAG(f"{name}-child")
    x = child.task("x", P + "sleep", kwargs={"seconds": seconds}, max_attempts=3, backoff=FAST)
    child.task("y", P + "echo", kwargs={"n": 1}, upstream=[x], max_attempts=3, backoff=FAST)
    dag = DAG(name)
    a = dag.task("a", P + "echo", max_attempts=3, backoff=FAST)
    dag.run_dag("kid", dag=child, params={"day": "2026-11-29"}, upstream=[a], on_parent_end=policy)
    dag.task("b", P + "echo", upstream=["kid"], max_attempts=3, backoff=FAST)
    return dag


def children(cluster: Cluster, run_id: str) -> list[Any]:
    with cluster.store.engine.connect() as conn:
        query = sa.select(s.runs).where(s.runs.c.parent_run_id == run_id).order_by(s.runs.c.created_at)
        return list(conn.execute(query).all())


def one_child(cluster: Cluster, run_id: str, attempt: int) -> Any:
    return cluster.wait_for(
        lambda: [c for c in children(cluster, run_id) if c.parent_attempt == attempt], 30,
        f"the child of attempt {attempt}", run_id=run_id,
    )[0]  # fmt: skip


def kid_ended_once(cluster: Cluster, run_id: str, child: Any) -> None:
    """kid SUCCEEDED once, naming ``child``, with ``child``'s leaf results; b got them."""
    kid, y = cluster.store.reads.get_task(run_id, "kid"), cluster.store.reads.get_task(child.id, "y")
    assert kid.state is T.SUCCEEDED, kid
    assert kid.result == {"y": y.result} and y.result["kwargs"] == {"n": 1}, kid.result
    ended = [e for e in accepted(cluster.events(run_id), dst="SUCCEEDED") if e.key == "kid"]
    assert [e.reason for e in ended] == [f"child run {child.id} SUCCEEDED"], ended
    b = cluster.store.reads.get_task(run_id, "b")
    assert b.state is T.SUCCEEDED and b.result["upstream"] == {"kid": kid.result}


def verified(cluster: Cluster, *run_ids: str) -> None:
    cluster.assert_clean(run_ids)
    done = cluster.cli("verify", *run_ids)
    assert done.returncode == 0 and "no violation" in done.stdout, done.stdout + done.stderr


def test_one_child_per_attempt_under_a_kill_minus_9_and_duplicates(cluster: Cluster, tmp_path: Path) -> None:
    # Given w1, whose reconciler dies (SIGKILL) right after it first stores a child run; the other
    # workers run no reconciler, so what happens after the crash is the test's doing
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0", ORCHESTRATOR_DISPATCH_TIMEOUT="300")
    marker = tmp_path / "crashed-once"
    crash = {"ORCHESTRATOR_CRASH_AT": "after_child_commit", "ORCHESTRATOR_CRASH_MARKER": str(marker),
             "ORCHESTRATOR_WORKER_RECONCILER": "1"}  # fmt: skip
    w1 = cluster.worker("w1", concurrency=1, env=crash)
    run = cluster.orc.submit(parent_dag("kill-at-child", 3.0))

    # When a succeeds, kid waits, and w1's reconciler stores kid's child and is killed
    cluster.wait_for(marker.exists, 60, "the crash right after the child's commit", run_id=run.id)
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    child = one_child(cluster, run.id, 1)
    kid_row = cluster.wait_task(run.id, "kid", lambda t: t.state is T.WAITING, 5, "kid waiting")
    assert kid_row.attempt == 1
    assert [t.state for t in cluster.store.reads.get_tasks(child.id)] == [T.READY, T.PENDING]  # nothing published
    # and the start is made again for the same attempt (a second pass, another process)
    with cluster.store.engine.connect() as conn:
        spec = conn.execute(
            sa.select(s.tasks.c.wait_spec).where(s.tasks.c.run_id == run.id, s.tasks.c.key == "kid")
        ).scalar_one()
    assert cluster.orc.children.start(Pending(run.id, "kid", 1, "default", dict(spec))) is False
    assert cluster.orc.children.tick() == 0
    # and, once two idle workers register (a registration admits READY work: x is published),
    # a second copy of x's message is delivered while x runs
    wa, wb = cluster.start_worker("wa", concurrency=1), cluster.start_worker("wb", concurrency=1)
    cluster.wait_ready(wa, wb)
    cluster.wait_task(child.id, "x", lambda t: t.state is T.RUNNING, 30, "x running")
    with cluster.store.engine.connect() as conn:
        x = conn.execute(
            sa.select(*rows.DISPATCH_COLUMNS).where(s.tasks.c.run_id == child.id, s.tasks.c.key == "x")
        ).one()
    copy = rows.dispatch(x._mapping)
    assert (copy.run_id, copy.key, copy.attempt) == (child.id, "x", 1)
    assert cluster.orc.publisher.publish([copy]) == 1
    cluster.reconciler()

    # Then one child for attempt 1, its x ran once (the copy's claim refused), and kid ended once
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    assert [(c.id, c.parent_attempt, c.state) for c in children(cluster, run.id)] == [(child.id, 1, "SUCCEEDED")]
    kid_ended_once(cluster, run.id, child)
    assert cluster.effects(child.id)[("x", 1)] == 1
    cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(child.id), dst="RUNNING") if e.key == "x"], 60,
        "the duplicate's refused claim", run_id=child.id,
    )  # fmt: skip
    started = [e for e in cluster.events(run.id) if e.key == "kid" and e.kind == "child_run"]
    assert [e.reason for e in started] == [f"started child run {child.id} (kill-at-child-child)"]
    verified(cluster, run.id, child.id)


def test_the_worker_running_the_childs_task_killed(cluster: Cluster) -> None:
    # Given the child's x running on w1 (its reconciler in its main process)
    w1 = cluster.worker("w1", concurrency=1)
    run = cluster.orc.submit(parent_dag("kill-child-task", 6.0))
    child = one_child(cluster, run.id, 1)
    cluster.wait_for(lambda: cluster.effects(child.id)[("x", 1)] == 1, 60, "x's body started", run_id=child.id)
    cluster.wait_task(child.id, "x", lambda t: t.state is T.RUNNING, 10, "x claimed")

    # When w1 (main process and pool) is SIGKILLed and w2 starts
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.restore_unacked()
    cluster.worker("w2", concurrency=2)

    # Then the lost attempt is retried in the same child; kid ends once with the child's result
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    assert [(c.id, c.parent_attempt) for c in children(cluster, run.id)] == [(child.id, 1)]
    assert cluster.store.reads.run_state(child.id) is RunState.SUCCEEDED
    kid_ended_once(cluster, run.id, child)
    x_attempts = [e.attempt for e in accepted(cluster.events(child.id), dst="SUCCEEDED") if e.key == "x"]
    assert len(x_attempts) == 1 and x_attempts[0] >= 2, x_attempts
    verified(cluster, run.id, child.id)


@pytest.mark.parametrize("policy", ["cancel", "abandon"])
def test_a_cancel_of_the_parent(cluster: Cluster, policy: str) -> None:
    # Given a parent whose kid waits on a child whose x runs for 3 s
    cluster.worker("w1", concurrency=2)
    run = cluster.orc.submit(parent_dag(f"cancel-{policy}", 3.0, policy=policy))
    child = one_child(cluster, run.id, 1)
    cluster.wait_task(child.id, "x", lambda t: t.state is T.RUNNING, 30, "x running")

    # When the parent run is cancelled
    cluster.orc.cancel(run.id)

    # Then kid is CANCELLED; the child is cancelled with it (cancel), or runs to its end (abandon)
    assert cluster.store.reads.get_task(run.id, "kid").state is T.CANCELLED
    want = RunState.CANCELLED if policy == "cancel" else RunState.SUCCEEDED
    assert cluster.wait_run(child.id, 60) is want
    note = f"cancelled child run {child.id} (on_parent_end=cancel)"

    def notes() -> list[str]:
        return [e.reason for e in cluster.events(run.id) if e.key == "kid" and e.kind == "child_run"]

    if policy == "cancel":  # the pass writes its note right after the cancel commits
        cluster.wait_for(lambda: note in notes(), 10, "the note of the cancel", run_id=run.id)
    else:
        assert note not in notes()
    assert cluster.store.reads.run_state(run.id) is RunState.CANCELLED
    assert len(children(cluster, run.id)) == 1
    verified(cluster, run.id, child.id)


@pytest.mark.parametrize("policy", ["cancel", "abandon"])
def test_a_clear_of_the_parent_node(cluster: Cluster, policy: str) -> None:
    # Given a parent whose kid waits on its first child, whose x runs for 3 s
    cluster.worker("w1", concurrency=2)
    run = cluster.orc.submit(parent_dag(f"clear-{policy}", 3.0, policy=policy))
    first = one_child(cluster, run.id, 1)
    cluster.wait_task(first.id, "x", lambda t: t.state is T.RUNNING, 30, "x running")

    # When kid is cleared
    assert cluster.orc.clear(run.id, "kid") == ["kid"]

    # Then attempt 2 has its own child; the first is cancelled (cancel) or left to finish
    # (abandon), and kid ends once, with the second child's result
    second = one_child(cluster, run.id, 2)
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    want = RunState.CANCELLED if policy == "cancel" else RunState.SUCCEEDED
    assert cluster.wait_run(first.id, 60) is want
    assert [(c.id, c.parent_attempt) for c in children(cluster, run.id)] == [(first.id, 1), (second.id, 2)]
    kid_ended_once(cluster, run.id, second)
    verified(cluster, run.id, first.id, second.id)
