"""Maps under faults: a worker SIGKILLed around a 10,000-wide expansion (right after the
source's success committed it, and while the statement that commits it runs), a worker
SIGKILLed while the join runs, and Redis flushed while the map's children run.

Each scenario ends with the database's invariants (``check_runs``, maps included) and
``orchestrator verify`` passing, and every child committed exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, accepted, rejected, worker_pid

pytestmark = pytest.mark.fault
T = TaskState
D = "tasks.dynamic."
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}
WIDE = 10_000


def map_dag(
    name: str, n: int, *, seconds: float = 0.0, item: dict[str, Any] | None = None, join: dict[str, Any] | None = None
) -> DAG:
    """ls (a listing of n after ``seconds``) -> m (a child per item) -> join (their results, in map order)."""
    dag = DAG(name)
    ls = dag.task("ls", D + "listing", kwargs={"n": n, "seconds": seconds}, max_attempts=3, backoff=FAST_BACKOFF)
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs=item or {}, max_attempts=3, backoff=FAST_BACKOFF)
    dag.task("join", D + "collect", kwargs=join or {}, upstream=[m], max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def committed_once(cluster: Cluster, run_id: str, n: int) -> Counter[str]:
    """Assert the map has its n children, each SUCCEEDED with exactly one accepted result; the
    join got their results in map order. Returns the executions per child (effects)."""
    tasks = {t.key: t for t in cluster.store.reads.get_tasks(run_id)}
    kids = sorted((t for t in tasks.values() if t.map_parent == "m"), key=lambda t: t.map_index or 0)
    assert [t.map_index for t in kids] == list(range(n))
    assert all(t.state is T.SUCCEEDED for t in kids), Counter(t.state.value for t in kids)
    successes = Counter(e.key for e in accepted(cluster.events(run_id), dst="SUCCEEDED"))
    assert all(successes[t.key] == 1 for t in kids), [(k, c) for k, c in successes.items() if c != 1]
    assert tasks["m"].state is T.SUCCEEDED
    assert tasks["m"].map_counts == {"total": n, "done": n, "succeeded": n, "failed": 0, "skipped": 0}
    assert tasks["join"].state is T.SUCCEEDED and successes["join"] == 1
    assert tasks["join"].result == {"m": list(range(n))}
    runs: Counter[str] = Counter()
    for (key, _), count in cluster.effects(run_id).items():
        runs[key] += count
    return runs


def verified(cluster: Cluster, run_id: str) -> None:
    """``check_runs`` (and an empty broker), then ``orchestrator verify`` on the run."""
    cluster.assert_clean([run_id])
    done = cluster.cli("verify", run_id)
    assert done.returncode == 0 and "no violation" in done.stdout, done.stdout + done.stderr


SUCCEEDING = (
    "FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%orc_succeed_v2%'"
    " AND pid <> pg_backend_pid() AND datname = current_database()"
)


def succeed_running(cluster: Cluster) -> bool:
    """Whether a session is running the statement that commits a result (ls's: and its expansion)."""
    with cluster.store.engine.connect() as conn:
        return bool(conn.execute(sa.text("SELECT count(*) " + SUCCEEDING)).scalar_one())


def terminate_succeeding(cluster: Cluster) -> int:
    """End the sessions still running that statement, as Postgres does once it notices its client
    is gone (``client_connection_check_interval``): the statement's transaction rolls back."""
    with cluster.store.engine.connect() as conn:
        return len(conn.execute(sa.text("SELECT pg_terminate_backend(pid) " + SUCCEEDING)).all())


def test_pool_child_killed_right_after_committing_a_10000_wide_expansion(cluster: Cluster, tmp_path: Path) -> None:
    # Given a worker armed to die right after its first result commit: ls's, which expands the map
    marker = tmp_path / "crashed-once"
    w1 = cluster.worker(
        "w1",
        concurrency=2,
        env={
            "ORCHESTRATOR_CRASH_AT": "after_result_commit",
            "ORCHESTRATOR_CRASH_MARKER": str(marker),
            # 10,000 bodies: count them by the ledger, not by a write each
            "ORCHESTRATOR_RECORD_PROBE_EFFECTS": "0",
        },
    )
    cluster.reconciler()
    started = time.monotonic()
    run = cluster.orc.submit(map_dag("wide-expansion-after-commit", WIDE))

    # When ls commits SUCCEEDED with its 10,000 children and its pool process dies before the
    # ack and before publishing the children it made ready
    header = cluster.wait_task(run.id, "m", lambda t: t.state is not T.PENDING, 60, "the map expanded")
    expanded = time.monotonic() - started
    assert header.state is T.MAPPED and header.map_counts["total"] == WIDE
    cluster.wait_for(lambda: marker.exists(), 30, "the crash after ls's result commit", run_id=run.id)

    # Then the reconciler publishes the lost dispatches, every child runs, and the run succeeds
    assert cluster.wait_run(run.id, 240) is RunState.SUCCEEDED
    took = time.monotonic() - started
    cluster.wait_for(lambda: "exited with 'signal 9 (SIGKILL)'" in w1.text(), 20, "the lost child", run_id=run.id)
    committed_once(cluster, run.id, WIDE)
    events = cluster.events(run.id)
    assert [e.attempt for e in accepted(events, dst="SUCCEEDED") if e.key == "ls"] == [1]
    assert [e.to_state for e in events if e.key == "m" and e.accepted] == ["MAPPED", "SUCCEEDED"]
    verified(cluster, run.id)
    print(f"\n{WIDE}-wide map, crash after the expansion's commit: expanded {expanded:.1f}s, run {took:.1f}s")


def test_worker_killed_while_the_10000_wide_expansion_commits(cluster: Cluster) -> None:
    # Given a worker, a reconciler, and ls returning 10,000 items after a moment
    w1 = cluster.worker("w1", concurrency=2, env={"ORCHESTRATOR_RECORD_PROBE_EFFECTS": "0"})
    cluster.reconciler()
    dag = map_dag("wide-expansion-during-commit", WIDE, seconds=0.5)
    started = time.monotonic()
    run = cluster.orc.submit(dag)
    cluster.wait_task(run.id, "ls", lambda t: t.state is T.RUNNING, 30, "ls running")

    # When the whole worker is SIGKILLed while the statement committing ls's result and the
    # expansion runs, and its session is ended before that statement commits (if it was too
    # quick to catch, the worker dies right after it)
    deadline = time.monotonic() + 20
    caught = False
    while time.monotonic() < deadline:
        if succeed_running(cluster):
            caught = True
            break
        if cluster.store.reads.get_task(run.id, "ls").state is not T.RUNNING:
            break
        time.sleep(0.005)
    w1.signal_group(signal.SIGKILL)
    terminated = terminate_succeeding(cluster) if caught else 0
    w1.popen.wait(10)
    killed_at = time.monotonic() - started
    cluster.worker("w2", concurrency=2, env={"ORCHESTRATOR_RECORD_PROBE_EFFECTS": "0"})

    # Then the expansion happened exactly once (committed by that statement, or by a retry of
    # ls after its lease expired), every child ran, and the run succeeded
    assert cluster.wait_run(run.id, 240) is RunState.SUCCEEDED
    took = time.monotonic() - started
    committed_once(cluster, run.id, WIDE)
    events = cluster.events(run.id)
    ls_ok = [e.attempt for e in accepted(events, dst="SUCCEEDED") if e.key == "ls"]
    assert len(ls_ok) == 1
    assert [e.to_state for e in events if e.key == "m" and e.accepted] == ["MAPPED", "SUCCEEDED"]
    mapped_from = Counter(e.key for e in accepted(events, src="PENDING", dst="READY") if e.key.startswith("m["))
    assert len(mapped_from) == WIDE and set(mapped_from.values()) == {1}
    # the messages w1 had taken are redelivered (as after kombu's visibility timeout) and dropped
    cluster.restore_unacked()
    verified(cluster, run.id)
    how = f"during the commit ({terminated} session ended)" if caught else "around the commit"
    print(f"\n{WIDE}-wide map, worker killed {how} at {killed_at:.1f}s, ls committed by attempt {ls_ok[0]}:"
          f" run {took:.1f}s")  # fmt: skip


def test_worker_killed_during_the_join(cluster: Cluster) -> None:
    # Given a 200-wide map whose join takes 10 s (still running when a loaded machine's test gets
    # to kill it: 3 s could end before)
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(map_dag("join-killed", 200, join={"seconds": 10}))
    join = cluster.wait_task(run.id, "join", lambda t: t.state is T.RUNNING, 60, "the join running")
    assert os.getpgid(worker_pid(join)) == w1.pid
    cluster.wait_for(lambda: cluster.effects(run.id)[("join", 1)] == 1, 10, "the join's body started")

    # When the worker (main process and pool) is SIGKILLed, and another starts
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.worker("w2", concurrency=2)

    # Then the join's lease expires, attempt 2 gets the map's 200 results again, and the run succeeds
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    runs = committed_once(cluster, run.id, 200)
    join = cluster.store.reads.get_task(run.id, "join")
    assert join.attempt == 2 and (join.worker or "").startswith("w2@fault:")
    events = cluster.events(run.id)
    assert ("join", 1) in {(e.key, e.attempt) for e in accepted(events, src="RUNNING", dst="RETRYING")}
    assert runs["join"] == 2 and all(runs[f"m[{i}]"] >= 1 for i in range(200))
    cluster.restore_unacked(run.id, "join", 1)
    cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(run.id), dst="RUNNING") if e.key == "join"],
        20,
        "the join's stale attempt-1 redelivery to be refused",
        run_id=run.id,
    )
    verified(cluster, run.id)


def test_redis_flushed_while_the_map_runs(cluster: Cluster) -> None:
    # Given a 300-wide map of short children on one worker
    cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(map_dag("flushed", 300, item={"seconds": 0.02}))

    # When Redis loses every message while the children run
    cluster.wait_task(
        run.id, "m", lambda t: t.map_counts is not None and t.map_counts["done"] >= 50, 60, "50 children done"
    )
    cluster.redis.flushall()
    flushed = cluster.store.reads.get_task(run.id, "m").map_counts

    # Then the reconciler re-publishes the lost messages, every child is committed once and the join runs
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    assert flushed is not None and flushed["done"] < 300, "the flush landed mid-map"
    runs = committed_once(cluster, run.id, 300)
    assert all(runs[f"m[{i}]"] >= 1 for i in range(300))
    republished = accepted(cluster.events(run.id), src="QUEUED", dst="QUEUED", actor="reconciler")
    assert republished, "the lost messages were published again"
    verified(cluster, run.id)
