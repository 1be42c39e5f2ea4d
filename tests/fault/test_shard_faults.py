"""The sharded reconciler (issue 35) under faults, with real processes: two ``orchestrator
reconcile`` instances (ORCHESTRATOR_RECONCILER_SHARDS=8) beside a worker that runs no reconciler.

- One instance is killed -9 while it owns shards: once its lease has run out the other claims its
  shards (at a new epoch) and releases the retries that fell due there meanwhile; every run ends,
  each retry is released once (the ledger says so).
- One instance is paused past its lease (SIGSTOP) and resumed: the other took its shards over; the
  paused one, back, writes nothing it no longer owns (a write it tries is refused and recorded as
  a rejected ledger row naming the stale epoch), and nothing is applied twice.
- A reconciler paused between its admission and that transaction's commit (what the sharded chaos
  soak's ``pause_reconciler`` found): the queues' admission locks it took are freed once the
  transaction has been idle for the shards' lease, so another admission goes on; nothing twice.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store.shards import Fence, shard_of
from tests.fault.harness import QUEUES, Cluster, P, Proc, accepted

pytestmark = pytest.mark.fault
T = TaskState
K = 8
#: the shards' lease: long enough that the retries of a dead owner's shards fall due before the
#: other instance may claim them
LEASE = 6.0


def sharded(cluster: Cluster) -> None:
    cluster.configure(
        ORCHESTRATOR_RECONCILER_SHARDS=str(K),
        ORCHESTRATOR_RECONCILER_SHARD_LEASE=str(LEASE),
        ORCHESTRATOR_WORKER_RECONCILER="0",
    )


def owners(cluster: Cluster) -> dict[int, tuple[str | None, int, Any]]:
    with cluster.store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT shard, owner, epoch, claimed_at FROM orc_shards ORDER BY shard")).all()
    return {r.shard: (r.owner, r.epoch, r.claimed_at) for r in rows}


def split(cluster: Cluster, a: str, b: str) -> dict[int, tuple[str | None, int, Any]]:
    """Until the two instances hold K/2 shards each."""

    def check() -> dict[int, tuple[str | None, int, Any]] | None:
        got = owners(cluster)
        held = Counter(o for o, _, _ in got.values())
        return got if len(got) == K and held[a] == held[b] == K // 2 else None

    found: dict[int, tuple[str | None, int, Any]] = cluster.wait_for(check, 60, "the shards split between a and b")
    return found


def flaky_runs(cluster: Cluster, n: int) -> list[str]:
    ids = []
    for i in range(n):
        dag = DAG(f"sharded-{i}")
        dag.task("flaky", P + "flaky", kwargs={"fail_times": 1}, max_attempts=3,
                 backoff={"base": 1, "cap": 1, "jitter": "none"})  # fmt: skip
        ids.append(cluster.orc.submit(dag).id)
    return ids


def check_once(cluster: Cluster, run_ids: list[str]) -> list[Any]:
    """Every run SUCCEEDED, its retry released once (accepted RETRYING -> READY), the DB-only
    invariants hold; returns the releases."""
    for run_id in run_ids:
        assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
    releases = []
    for run_id in run_ids:
        got = accepted(cluster.events(run_id), src="RETRYING", dst="READY")
        assert len(got) == 1 and got[0].actor == "reconciler", (run_id, got)
        releases.append((run_id, got[0]))
    cluster.assert_clean(run_ids)
    return releases


def stale_refusals(cluster: Cluster) -> list[Any]:
    with cluster.store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT run_id, key, from_state, to_state, reason FROM orc_task_events"
                    " WHERE NOT accepted AND reason LIKE '%stale shard epoch%'"
                )
            ).all()
        )


def instance(proc: Proc) -> str:
    """The name ``orchestrator reconcile`` gives itself by default."""
    return f"reconcile@{socket.gethostname()}:{proc.pid}"


def test_a_killed_owners_shards_are_taken_over_and_their_due_retries_released_once(cluster: Cluster) -> None:
    # Given two sharded reconcilers that split the 8 shards, and runs whose task fails once
    sharded(cluster)
    cluster.worker("w1", concurrency=4)
    a, b = cluster.reconciler("a"), cluster.reconciler("b")
    name_a, name_b = instance(a), instance(b)
    before = split(cluster, name_a, name_b)
    mine_a = {s for s, (o, _, _) in before.items() if o == name_a}
    run_ids = flaky_runs(cluster, 16)
    in_a = [r for r in run_ids if shard_of(r, K) in mine_a]
    assert in_a, "no run fell in a's shards (1 chance in 65,536)"

    # When a is killed -9 as soon as a task of its shards failed (its retry due 1 s later)
    cluster.wait_for(
        lambda: any(cluster.store.reads.get_task(r, "flaky").attempt == 2 for r in in_a), 60, "a failure in a's shards"
    )
    a.signal_group(signal.SIGKILL)
    a.popen.wait(10)

    # Then b takes a's shards over once their lease ran out, at a new epoch, and every retry is
    # released once: those of a's shards still due at the kill by b, after its claim
    cluster.wait_for(lambda: all(o == name_b for o, _, _ in owners(cluster).values()), 60, "b holding every shard")
    releases = check_once(cluster, run_ids)
    after = owners(cluster)
    for shard in mine_a:
        assert after[shard][1] == before[shard][1] + 1, (shard, before[shard], after[shard])
    late = [(r, e) for r, e in releases if r in in_a and e.at >= after[shard_of(r, K)][2]]
    assert late, "no retry of a's shards was left for b to release"
    lags = sorted((e.at - after[shard_of(r, K)][2]).total_seconds() for r, e in late)
    print(
        f"killed owner: {len(late)} retries of its shards released by b, {lags[0]:.2f}..{lags[-1]:.2f}s after its claim"
    )
    assert b.popen.poll() is None


def test_a_paused_owner_resumed_after_the_take_over_applies_nothing_twice(cluster: Cluster) -> None:
    # Given two sharded reconcilers that split the shards
    sharded(cluster)
    cluster.worker("w1", concurrency=4)
    a, b = cluster.reconciler("a"), cluster.reconciler("b")
    name_a, name_b = instance(a), instance(b)
    split(cluster, name_a, name_b)

    # When a is paused past its lease (b takes everything), work falls due, and a resumes
    a.signal_group(signal.SIGSTOP)
    cluster.wait_for(lambda: all(o == name_b for o, _, _ in owners(cluster).values()), 60, "b holding every shard")
    run_ids = flaky_runs(cluster, 12)
    cluster.wait_for(
        lambda: any(cluster.store.reads.get_task(r, "flaky").attempt == 2 for r in run_ids), 60, "a failure"
    )
    a.signal_group(signal.SIGCONT)

    # Then every run ends with each retry released once; the shards split again; any write a
    # tried with its old epochs was refused and recorded, never applied
    check_once(cluster, run_ids)
    split(cluster, name_a, name_b)
    for row in stale_refusals(cluster):
        assert f"read by {name_a}" in row.reason, row
    print(f"paused owner: {len(stale_refusals(cluster))} stale-epoch writes refused")
    assert a.popen.poll() is None and b.popen.poll() is None


def test_a_reconciler_paused_inside_its_admission_holds_the_admission_locks_no_longer_than_the_lease(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given READY work (submitted while no worker was live) and then a worker's capacity row
    orc = cluster.orc
    dag = DAG("paused-admission")
    for i in range(4):
        dag.task(f"t{i}", P + "echo")
    run = orc.submit(dag)
    assert {t.state for t in orc.store.reads.get_tasks(run.id)} == {T.READY}
    orc.store.workers.register("fake@fault", list(QUEUES), 8, None)  # (the row alone: no admission of its own)
    # and a sharded reconciler (lease 1 s) whose admission stops between orc_admit_v2 and its
    # commit, as a process SIGSTOPped there does, until the test lets it go on
    admission = orc.store.admission
    real = admission.admit
    admitted, release = threading.Event(), threading.Event()

    def paused(conn: Any, window: int, *, wait: bool = True) -> Any:
        found = real(conn, window, wait=wait)
        if not admitted.is_set():
            admitted.set()
            release.wait(120)
        return found

    monkeypatch.setattr(admission, "admit", paused)
    fence = Fence("paused@test", K, {}, lease=1.0)
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(orc.reconciler._admit(fence)), daemon=True)
    thread.start()
    try:
        cluster.wait_for(admitted.is_set, 30, "the paused admission")

        # When another admission (a completion's, which waits for the queues' locks) comes meanwhile
        second: list[Any] = []
        other = threading.Thread(
            target=lambda: second.append(admission.admit_ready(orc.settings.dispatch_window, wait=True)), daemon=True
        )
        other.start()

        # Then it goes on while the first is still paused: the server ended the paused transaction
        # once idle for the lease, and rolled it back (what it admitted is READY again)
        cluster.wait_for(lambda: bool(second), 30, "the second admission, while the first is paused")
        assert not release.is_set() and thread.is_alive()
        assert {d.key for d in second[0]} == {f"t{i}" for i in range(4)}
    finally:
        release.set()
        thread.join(60)
    # And each task was admitted once (one accepted READY -> QUEUED each)
    events = cluster.events(run.id)
    once = Counter(e.key for e in accepted(events, src="READY", dst="QUEUED"))
    assert once == {f"t{i}": 1 for i in range(4)}, once
    assert {t.state for t in orc.store.reads.get_tasks(run.id)} == {T.QUEUED}
