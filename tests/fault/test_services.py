"""Service faults mid-run: Redis shut down (NOSAVE) and restarted, Redis flushed, the
application's Postgres backends terminated."""

from __future__ import annotations

import os
import signal
import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.conftest import db_url
from tests.fault.conftest import FAULT_DB
from tests.fault.harness import Cluster, P, Proc, republished

pytestmark = pytest.mark.fault
T = TaskState
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}


def _fan_dag(name: str, width: int = 12, seconds: float = 0.4) -> DAG:
    dag = DAG(name)
    root = dag.task("root", P + "noop", max_attempts=3, backoff=FAST_BACKOFF)
    mids = [
        dag.task(
            f"m{i}", P + "sleep", kwargs={"seconds": seconds}, upstream=[root], max_attempts=3, backoff=FAST_BACKOFF
        )
        for i in range(width)
    ]
    dag.task("sink", P + "echo", upstream=mids, max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def _mid_run(cluster: Cluster, run_id: str, done: int) -> None:
    """Until at least ``done`` tasks of the run succeeded (and some are still open)."""
    cluster.wait_for(
        lambda: sum(t.state is T.SUCCEEDED for t in cluster.store.reads.get_tasks(run_id)) >= done,
        30,
        f"{done} tasks done",
        run_id=run_id,
    )
    assert cluster.store.reads.run_state(run_id) is RunState.RUNNING, "the fault must hit a run in progress"


def _backlog_in_broker(cluster: Cluster, *workers: Proc) -> int:
    """Stop the workers' main processes (their pool children keep running tasks and publishing
    the children they admit) until some messages wait in the broker's queues; resume nothing."""
    for w in workers:
        os.kill(w.pid, signal.SIGSTOP)
        w.paused = True  # cluster teardown SIGCONTs it in any case

    def queued() -> int:
        return sum(n for k, n in cluster.broker_backlog().items() if k.startswith("orchestrator."))

    return int(cluster.wait_for(queued, 10, "messages waiting in the broker"))


def _resume(*workers: Proc) -> None:
    for w in workers:
        os.kill(w.pid, signal.SIGCONT)
        w.paused = False


def test_redis_shutdown_and_restart_mid_run(cluster: Cluster) -> None:
    # Given two workers, a reconciler and a run in progress
    w1, w2 = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
    cluster.wait_ready(w1, w2)
    cluster.reconciler()
    run = cluster.orc.submit(_fan_dag("redis-restart"))
    _mid_run(cluster, run.id, 3)
    waiting = _backlog_in_broker(cluster, w1, w2)

    # When Redis is shut down without saving (the queued and unacked messages are gone) and
    # restarted empty on the same port a second later
    cluster.redis_server.shutdown_nosave()
    _resume(w1, w2)
    time.sleep(1)
    cluster.redis_server.start()

    # Then the workers reconnect and consume again, the lost dispatches are re-published, and the run completes
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    assert len(republished(cluster.events(run.id))) >= waiting, "the lost messages were re-published"
    assert all(p.popen.poll() is None for p in cluster.procs)
    # And a run submitted after the restart goes through normally
    after = DAG("after-restart")
    after.task("a", P + "noop")
    again = cluster.orc.submit(after)
    assert cluster.wait_run(again.id, 30) is RunState.SUCCEEDED
    cluster.assert_clean([run.id, again.id])


def test_redis_flushall_mid_run(cluster: Cluster) -> None:
    # Given two workers, a reconciler and a run in progress
    w1, w2 = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
    cluster.wait_ready(w1, w2)
    cluster.reconciler()
    run = cluster.orc.submit(_fan_dag("redis-flush"))
    _mid_run(cluster, run.id, 3)
    waiting = _backlog_in_broker(cluster, w1, w2)

    # When every key of the broker is flushed (queued messages, unacked bookkeeping, bindings)
    cluster.redis.flushall()
    _resume(w1, w2)

    # Then the workers keep consuming, the QUEUED rows whose messages vanished are re-published
    # once each, and the run completes
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    again_published = republished(cluster.events(run.id))
    assert len(again_published) >= waiting and set(again_published.values()) == {1}, again_published
    assert all(p.popen.poll() is None for p in cluster.procs)
    after = DAG("after-flush")
    after.task("a", P + "noop")
    again = cluster.orc.submit(after)
    assert cluster.wait_run(again.id, 30) is RunState.SUCCEEDED
    cluster.assert_clean([run.id, again.id])


def _terminate_backends() -> int:
    admin = sa.create_engine(db_url("postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return len(
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": FAULT_DB},
                ).all()
            )
    finally:
        admin.dispose()


def test_postgres_backends_terminated_mid_run(cluster: Cluster) -> None:
    # Given two workers, a reconciler and a run in progress
    w1, w2 = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
    cluster.wait_ready(w1, w2)
    cluster.reconciler()
    run = cluster.orc.submit(_fan_dag("pg-terminate", width=16))
    _mid_run(cluster, run.id, 2)

    # When every backend of the application's database is terminated, every 0.25 s for 3 s
    killed = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        killed.append(_terminate_backends())
        time.sleep(0.25)
    assert sum(killed) > 0, killed

    # Then pool pre-ping and the bounded transaction retries carry on, and the run completes
    assert cluster.wait_run(run.id, 90) is RunState.SUCCEEDED
    assert all(p.popen.poll() is None for p in cluster.procs)
    cluster.assert_clean([run.id])
