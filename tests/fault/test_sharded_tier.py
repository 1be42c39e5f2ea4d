"""The fault tier with the sharded control plane on (issue 35, ``ORCHESTRATOR_RECONCILER_SHARDS``):
the sharded counterparts of what tests/fault/test_reconciler.py protects with the duty lock
(``on_duty``, which the sharded mode does not take), and a short soak.

Real prefork workers on the fault suite's private Redis, each worker's reconciler service sharded
8 ways, no beat and no ``orchestrator reconcile``: the workers' own services are all there is.

- a retry is released while the pool is saturated (the service runs beside the pool, holding
  every shard);
- a deployment of workers only retries and recovers (the shards split between the workers);
- a worker killed -9 while its reconciler owns shards: the survivor claims them (each at a new
  epoch) once their lease has run out, and every run ends, each retry released once;
- ``orchestrator chaos --reconciler-shards 8``: every kind of fault, the sharded ones among them
  (a reconcile instance killed -9 while it owns shards, one paused past its lease), and nothing
  lost, committed twice or stuck.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store.shards import shard_of
from orchestrator.testing.chaos import KINDS
from orchestrator.testing.chaos.faults import SHARDED_KINDS
from tests.fault.harness import Cluster, P, accepted, rejected, worker_pid
from tests.fault.test_chaos import fault_counts, soak

pytestmark = pytest.mark.fault
T = TaskState
K = 8
#: the shards' lease: a killed worker's shards wait this long (plus a tick) for the survivor
LEASE = 4.0


def sharded(cluster: Cluster) -> None:
    """Every worker's reconciler service sharded K ways (the workers' own services: the default)."""
    cluster.configure(ORCHESTRATOR_RECONCILER_SHARDS=str(K), ORCHESTRATOR_RECONCILER_SHARD_LEASE=f"{LEASE:g}")


def owners(cluster: Cluster) -> dict[int, tuple[str | None, int, Any]]:
    """Each shard's owner, epoch and when it was claimed."""
    with cluster.store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT shard, owner, epoch, claimed_at FROM orc_shards ORDER BY shard")).all()
    return {r.shard: (r.owner, r.epoch, r.claimed_at) for r in rows}


def held_by(cluster: Cluster, *names: str) -> dict[int, tuple[str | None, int, Any]] | None:
    """The shards, once all K are held by ``names`` in equal parts (else ``None``)."""
    got = owners(cluster)
    held = Counter(o for o, _, _ in got.values())
    share = K // len(names)
    return got if len(got) == K and all(held[n] == share for n in names) else None


def releases_once(cluster: Cluster, run_id: str) -> list[Any]:
    """The run's accepted RETRYING -> READY releases, each (key, attempt) released once, by the
    reconciler."""
    got = accepted(cluster.events(run_id), src="RETRYING", dst="READY")
    assert all(e.actor == "reconciler" for e in got), got
    twice = [k for k, n in Counter((e.key, e.attempt) for e in got).items() if n > 1]
    assert not twice, (run_id, twice)
    return got


def test_a_retry_is_released_while_the_pool_is_saturated(cluster: Cluster) -> None:
    # Given one sharded worker with two slots and no other process: a task that fails once
    # (retry due 3 s later) and two long tasks (30 s) that take both slots once it has failed
    # (as tests/fault/test_reconciler.py's duty-lock twin)
    sharded(cluster)
    w = cluster.worker("w1", concurrency=2)
    dag = DAG("saturated")
    dag.task("flaky", P + "flaky", kwargs={"fail_times": 1}, max_attempts=3, priority="high",
             backoff={"base": 3, "cap": 3, "jitter": "none"})  # fmt: skip
    dag.task("long1", P + "sleep", kwargs={"seconds": 30})
    dag.task("long2", P + "sleep", kwargs={"seconds": 30})
    run = cluster.orc.submit(dag)

    # When the retry falls due while both slots are busy
    cluster.wait_task(
        run.id, "flaky", lambda t: t.state in (T.READY, T.QUEUED) and t.attempt == 2, 60, "the retry released"
    )
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED

    # Then the worker's sharded service, beside the pool, released it once due while both
    # slots were busy (by the ledger's order and times); it held every shard, the run's among them
    events = cluster.events(run.id)
    failed = accepted(events, src="RUNNING", dst="RETRYING")[0]
    released = accepted(events, src="RETRYING", dst="READY")[0]
    assert released.actor == "reconciler"
    lag = (released.at - failed.at).total_seconds()
    at = {id(e): i for i, e in enumerate(events)}
    claims = {e.key: at[id(e)] for e in accepted(events, src="QUEUED", dst="RUNNING") if e.key.startswith("long")}
    ends = {e.key: at[id(e)] for e in accepted(events, src="RUNNING", dst="SUCCEEDED") if e.key.startswith("long")}
    print(f"sharded, saturated pool: retry due 3 s after the failure, released after {lag:.2f} s")
    assert lag >= 3, f"released {lag:.2f}s after the failure, before it was due"
    assert set(claims) == set(ends) == {"long1", "long2"}
    assert all(i < at[id(released)] for i in claims.values()), "both slots were busy when the retry was released"
    assert all(i > at[id(released)] for i in ends.values()), "released before a slot freed"
    shards = owners(cluster)
    assert {o for o, _, _ in shards.values()} == {"w1@fault"}, shards
    assert cluster.store.reads.reconciler_on_duty() == []  # no duty lock in the sharded mode
    assert not rejected(events, actor="reconciler")
    assert w.popen.poll() is None
    cluster.assert_clean([run.id])


def test_a_deployment_of_workers_only_retries_and_recovers(cluster: Cluster) -> None:
    # Given two sharded workers and nothing else (no beat, no `orchestrator reconcile`)
    sharded(cluster)
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    cluster.wait_for(lambda: held_by(cluster, "w1@fault", "w2@fault"), 60, "the shards split between w1 and w2")
    dag = DAG("workers-only")
    dag.task("flaky", P + "flaky", kwargs={"fail_times": 2}, max_attempts=4, backoff={"base": 0.2, "cap": 0.5})
    # (8 s: still running when a loaded machine's test gets to kill it)
    victim = dag.task("victim", P + "sleep", kwargs={"seconds": 8}, max_attempts=3, backoff={"base": 0.2, "cap": 0.5})
    dag.task("after", P + "echo", upstream=[victim])
    run = cluster.orc.submit(dag)

    # When the pool process running "victim" is killed
    task = cluster.wait_task(run.id, "victim", lambda t: t.state is T.RUNNING, 30, "victim running")
    os.kill(worker_pid(task), signal.SIGKILL)

    # Then the retries are released and the lost lease expired by the service owning the run's shard
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    events = cluster.events(run.id)
    assert [(e.key, e.attempt) for e in accepted(events, src="RUNNING", dst="RETRYING", actor="reconciler")] == [
        ("victim", 1)
    ]
    assert len(releases_once(cluster, run.id)) == 3  # flaky x2, victim x1
    owner = owners(cluster)[shard_of(run.id, K)][0]
    print(f"workers only, sharded: run in shard {shard_of(run.id, K)} of {owner}")
    assert owner in ("w1@fault", "w2@fault")
    cluster.assert_clean([run.id])


def flaky_runs(cluster: Cluster, n: int) -> list[str]:
    """``n`` runs of a task that fails once (its retry due 1 s later) and a short one below it."""
    ids = []
    for i in range(n):
        dag = DAG(f"sharded-kill-{i}")
        first = dag.task("flaky", P + "flaky", kwargs={"fail_times": 1}, max_attempts=5,
                         backoff={"base": 1, "cap": 1, "jitter": "none"})  # fmt: skip
        dag.task("after", P + "sleep", kwargs={"seconds": 0.5}, upstream=[first], max_attempts=5,
                 backoff={"base": 0.2, "cap": 0.5})  # fmt: skip
        ids.append(cluster.orc.submit(dag).id)
    return ids


def test_killing_a_worker_that_owns_shards_moves_them_to_the_survivor(cluster: Cluster) -> None:
    # Given two sharded workers that split the 8 shards, and runs in both halves
    sharded(cluster)
    wa, wb = cluster.start_worker("wa", concurrency=2), cluster.start_worker("wb", concurrency=2)
    cluster.wait_ready(wa, wb)
    before = cluster.wait_for(lambda: held_by(cluster, "wa@fault", "wb@fault"), 60, "the shards split")
    mine_a = {shard for shard, (o, _, _) in before.items() if o == "wa@fault"}
    run_ids = flaky_runs(cluster, 16)
    in_a = [r for r in run_ids if shard_of(r, K) in mine_a]
    assert in_a, "no run fell in wa's shards (1 chance in 65,536)"

    # When wa (main process and pool) is killed -9 once a task of its shards has failed
    cluster.wait_for(
        lambda: any(cluster.store.reads.get_task(r, "flaky").attempt >= 2 for r in in_a), 60, "a failure in wa's shards"
    )
    wa.signal_group(signal.SIGKILL)
    wa.popen.wait(10)
    killed = time.monotonic()

    # Then wb claims wa's shards, each at the next epoch, once their lease has run out; every
    # run ends, each retry released once by the reconciler
    cluster.wait_for(lambda: held_by(cluster, "wb@fault"), 60, "wb holding every shard")
    took = time.monotonic() - killed
    after = owners(cluster)
    for shard in mine_a:
        assert after[shard][1] == before[shard][1] + 1, (shard, before[shard], after[shard])
    for run_id in run_ids:
        assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
        releases_once(cluster, run_id)
    print(f"killed worker's {len(mine_a)} shards held by the survivor {took:.2f} s after the kill (lease {LEASE:g} s)")
    assert wb.popen.poll() is None
    # (the messages wa had taken stay unacked until kombu's visibility timeout: restored now,
    # redelivered to wb, which drops them; the claim refuses their stale attempt)
    cluster.restore_unacked()
    cluster.assert_clean(run_ids)


def test_a_short_soak_with_the_sharded_control_plane_keeps_the_promise() -> None:
    out = soak("--runs", "4", "--min-faults", "28", "--seed", "3", "--workers", "2", "--reconcilers", "2",
               "--reconciler-shards", "8", "--timeout", "120", timeout=170)  # fmt: skip
    counts = fault_counts(out)
    assert set(counts) == set(KINDS) | set(SHARDED_KINDS), out  # every kind, the sharded ones among them
    assert "reconciler shards 8" in out, out
    found = re.search(r"stale-epoch refusals \(a deposed owner's writes, refused and recorded\): (\d+)", out)
    assert found, out
    killed = re.search(r"reconcile instances killed -9: (\d+), (\d+) of them owning shards", out)
    assert killed and int(killed.group(1)) == counts["kill_reconciler"] and int(killed.group(2)) >= 1, out
    assert "lost: 0  committed twice: 0  stuck: 0" in out, out
    assert "violation:" not in out, out
