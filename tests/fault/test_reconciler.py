"""Where the reconciler runs: beside the workers' pools, never queued behind user tasks.

Real prefork workers on the fault suite's private Redis, no beat and no separate
``orchestrator reconcile``: the workers' own reconciler services are all there is.

These run the default mode, one reconciler on duty (the duty lock, ``on_duty``); their sharded
counterparts (``ORCHESTRATOR_RECONCILER_SHARDS``, no duty lock) are in test_sharded_tier.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, P, accepted, worker_pid

pytestmark = pytest.mark.fault
T = TaskState


def on_duty(cluster: Cluster) -> list[str]:
    """``application_name`` of the session holding the reconciler duty in the test database."""
    return cluster.store.reads.reconciler_on_duty()


def test_a_retry_is_released_while_the_pool_is_saturated(cluster: Cluster) -> None:
    # Given one worker with two slots and no other process: a task that fails once (retry due
    # 3 s later), and two long tasks (30 s) that take both slots as soon as it has failed (3 s
    # and 30 s: a loaded machine claims the second one and reaches the release in time; with
    # 0.5 s and 8 s the release could come first)
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

    # Then it was released once due, by the reconciler beside the pool, while both slots were
    # busy with the long tasks: both claimed before the release, neither finished before it (by
    # the ledger's order and times, not by how fast this machine ran the test)
    events = cluster.events(run.id)
    failed = accepted(events, src="RUNNING", dst="RETRYING")[0]
    released = accepted(events, src="RETRYING", dst="READY")[0]
    assert released.actor == "reconciler"
    lag = (released.at - failed.at).total_seconds()
    # (the ledger's order: cluster.events is oldest first)
    at = {id(e): i for i, e in enumerate(events)}
    claims = {e.key: at[id(e)] for e in accepted(events, src="QUEUED", dst="RUNNING") if e.key.startswith("long")}
    ends = {e.key: at[id(e)] for e in accepted(events, src="RUNNING", dst="SUCCEEDED") if e.key.startswith("long")}
    print(f"saturated pool: retry due 3 s after the failure, released after {lag:.2f} s")
    assert lag >= 3, f"released {lag:.2f}s after the failure, before it was due"
    assert set(claims) == set(ends) == {"long1", "long2"}
    assert all(i < at[id(released)] for i in claims.values()), "both slots were busy when the retry was released"
    assert all(i > at[id(released)] for i in ends.values()), "released before a slot freed"
    assert "orchestrator-reconciler:w1@fault" in on_duty(cluster)
    assert w.popen.poll() is None
    cluster.assert_clean([run.id])


def test_a_deployment_of_workers_only_retries_and_recovers(cluster: Cluster) -> None:
    # Given two workers and nothing else (no beat, no `orchestrator reconcile`)
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    dag = DAG("workers-only")
    dag.task("flaky", P + "flaky", kwargs={"fail_times": 2}, max_attempts=4, backoff={"base": 0.2, "cap": 0.5})
    # (8 s: still running when a loaded machine's test gets to kill it; 3 s could end before)
    victim = dag.task("victim", P + "sleep", kwargs={"seconds": 8}, max_attempts=3, backoff={"base": 0.2, "cap": 0.5})
    dag.task("after", P + "echo", upstream=[victim])
    run = cluster.orc.submit(dag)

    # When the pool process running "victim" is killed
    task = cluster.wait_task(run.id, "victim", lambda t: t.state is T.RUNNING, 30, "victim running")
    os.kill(worker_pid(task), signal.SIGKILL)

    # Then retries are released and the lost lease is expired by the workers' reconciler
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    events = cluster.events(run.id)
    assert [(e.key, e.attempt) for e in accepted(events, src="RUNNING", dst="RETRYING", actor="reconciler")] == [
        ("victim", 1)
    ]
    assert len(accepted(events, src="RETRYING", dst="READY", actor="reconciler")) == 3  # flaky x2, victim x1
    cluster.assert_clean([run.id])


def test_killing_the_process_on_duty_moves_the_duty(cluster: Cluster) -> None:
    # Given two workers, one of them on duty
    workers = {
        w.name: w for w in (cluster.start_worker("wa", concurrency=1), cluster.start_worker("wb", concurrency=1))
    }
    cluster.wait_ready(*workers.values())
    holder = cluster.wait_for(lambda: on_duty(cluster), 60, "a reconciler on duty")[0]
    name = holder.removeprefix("orchestrator-reconciler:").split("@")[0]
    victim, survivor = workers[name], workers[next(n for n in workers if n != name)]

    # When the worker on duty is killed (-9, the whole process group)
    os.killpg(victim.pid, signal.SIGKILL)
    killed = time.monotonic()

    # Then the other worker is on duty (within about a tick, 0.3 s, on an idle machine: the
    # dead session's lock goes with it; the bound is generous for a loaded one), and still
    # recovers work
    cluster.wait_for(lambda: on_duty(cluster) == [f"orchestrator-reconciler:{survivor.name}@fault"], 30, "takeover")
    took = time.monotonic() - killed
    print(f"reconciler duty moved {took:.2f} s after the process on duty was killed (tick 0.3 s)")
    dag = DAG("after-takeover")
    dag.task("flaky", P + "flaky", kwargs={"fail_times": 1}, max_attempts=3, backoff={"base": 0.2, "cap": 0.2})
    run = cluster.orc.submit(dag)
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    cluster.assert_clean([run.id])


def _pool_children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return {int(x) for x in out.stdout.split()}


def test_duty_moves_when_only_the_main_process_dies(cluster: Cluster) -> None:
    # Given a worker on duty whose pool re-forked a child after it took the duty (the new
    # child inherits the process's sockets), and a second worker
    wa = cluster.worker("wa", concurrency=1)
    cluster.wait_for(lambda: on_duty(cluster) == ["orchestrator-reconciler:wa@fault"], 60, "wa on duty")
    wb = cluster.worker("wb", concurrency=1)
    before = _pool_children(wa.pid)
    assert before, "wa has a pool child"
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    cluster.wait_for(lambda: _pool_children(wa.pid) - before, 20, "a re-forked pool child")

    # When only wa's main process is killed (its re-forked child lives on for a while)
    os.kill(wa.pid, signal.SIGKILL)
    killed = time.monotonic()

    # Then the duty still moves: the child does not keep the duty session open (within about
    # a tick on an idle machine; the bound is generous for a loaded one)
    cluster.wait_for(lambda: on_duty(cluster) == ["orchestrator-reconciler:wb@fault"], 30, "takeover by wb")
    took = time.monotonic() - killed
    print(f"duty moved {took:.2f} s after the main process on duty was killed (its pool child alive)")
    assert wb.popen.poll() is None
