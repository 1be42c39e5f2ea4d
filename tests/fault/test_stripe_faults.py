"""Striped fan-ins (migration 0038) under real faults: a worker SIGKILLed while the parents of a
wide join run, and a clear of parents whose successes are held in their stripes while the
others still run. Nothing lost, nothing committed twice, the join READY once, the run closed
with every stripe filled (checked from the database)."""

from __future__ import annotations

import os
import signal

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, P, accepted

pytestmark = pytest.mark.fault
T = TaskState
WIDTH = 48  # 4 stripes of 12 parents
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}


def _fan_in(name: str, seconds: float) -> DAG:
    dag = DAG(name)
    dag.task("root", P + "noop")
    mids = [
        dag.task(f"m{i:02d}", P + "sleep", kwargs={"seconds": seconds}, upstream=["root"], max_attempts=3,
                 backoff=FAST_BACKOFF)
        for i in range(WIDTH)
    ]  # fmt: skip
    dag.task("join", P + "noop", upstream=mids)
    return dag


def _stripes(cluster: Cluster, run_id: str) -> list[tuple[int, int, int]]:
    with cluster.store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT quota, arrived, pending FROM orc_stripes WHERE run_id = :r ORDER BY stripe"),
            {"r": run_id},
        ).all()
    return [tuple(r) for r in rows]


def _held(cluster: Cluster, run_id: str) -> list[str]:
    """The parents whose successes are held in a stripe that has not filled."""
    with cluster.store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT t.key FROM orc_tasks t JOIN orc_stripes st ON st.run_id = t.run_id"
                    " AND st.key = 'join' AND st.stripe = t.stripe"
                    " WHERE t.run_id = :r AND t.state = 'SUCCEEDED' AND st.arrived < st.quota ORDER BY t.key"
                ),
                {"r": run_id},
            ).scalars()
        )


def _assert_once(cluster: Cluster, run_id: str) -> None:
    events = cluster.events(run_id)
    successes = [e.key for e in accepted(events, dst="SUCCEEDED") if e.key is not None]
    assert sorted(successes) == sorted({*successes}), "a task committed twice"
    ready = [e for e in accepted(events, src="PENDING", dst="READY") if e.key == "join"]
    assert len(ready) == 1
    assert all(q == a and p == 0 for q, a, p in _stripes(cluster, run_id)), _stripes(cluster, run_id)
    with cluster.store.engine.connect() as conn:
        counts = conn.execute(
            sa.text("SELECT n_done, n_succeeded FROM orc_tasks WHERE run_id = :r AND key = 'join'"), {"r": run_id}
        ).one()
    assert tuple(counts) == (WIDTH, WIDTH)
    cluster.assert_clean([run_id])


def test_a_worker_killed_while_a_striped_fan_in_runs(cluster: Cluster) -> None:
    # Given two prefork workers, a reconciler, and a 1 -> 48 -> 1 fan-out in 4 stripes
    cluster.configure(ORCHESTRATOR_FANIN_STRIPES="4")
    w1 = cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(_fan_in("stripes-kill", 0.3))
    assert [q for q, _, _ in _stripes(cluster, run.id)] == [12, 12, 12, 12]
    # When some successes are held in their stripes and w1 is killed (-9, its whole group)
    cluster.wait_for(lambda: _held(cluster, run.id), 120, "a success held in its stripe", run_id=run.id)
    os.killpg(w1.pid, signal.SIGKILL)
    # Then the other worker and the reconciler finish the run: every stripe filled once
    assert cluster.wait_run(run.id, 240) is RunState.SUCCEEDED
    # (w1's prefetched messages stay unacked until the visibility timeout: restored now, as a live
    # worker does after it, their redelivery is refused by the claim's compare-and-set)
    cluster.restore_unacked()
    _assert_once(cluster, run.id)


def test_a_clear_of_held_parents_while_the_others_run(cluster: Cluster) -> None:
    # Given a striped fan-in running on one worker
    cluster.configure(ORCHESTRATOR_FANIN_STRIPES="4")
    cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(_fan_in("stripes-clear", 0.2))
    held = cluster.wait_for(lambda: _held(cluster, run.id)[:2] or None, 120, "held successes", run_id=run.id)
    # When two parents whose successes are held are cleared while the others still run
    done = cluster.cli("clear", run.id, *held)
    assert done.returncode == 0, done.stdout + done.stderr
    # Then they run again, the join runs once after every parent, and the run succeeds
    assert cluster.wait_run(run.id, 240) is RunState.SUCCEEDED
    for key in held:
        assert cluster.store.reads.get_task(run.id, key).attempt == 2
    _assert_once_after_clear(cluster, run.id, held)


def _assert_once_after_clear(cluster: Cluster, run_id: str, cleared: list[str]) -> None:
    events = cluster.events(run_id)
    per: dict[tuple[str, int], int] = {}
    for e in accepted(events, dst="SUCCEEDED"):
        if e.key is not None:
            per[(e.key, e.attempt)] = per.get((e.key, e.attempt), 0) + 1
    assert all(n == 1 for n in per.values()), "an attempt committed twice"
    assert {k for (k, a) in per if a == 2} == set(cleared)
    assert all(q == a and p == 0 for q, a, p in _stripes(cluster, run_id)), _stripes(cluster, run_id)
    cluster.assert_clean([run_id])
