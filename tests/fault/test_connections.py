"""Bounded connections: a threads worker shares a few Postgres connections among its threads, and
a deployment runs through a real PgBouncer in transaction mode (the reconciler's duty lock on a
direct connection of its own), a worker killed -9 mid-run included."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.conftest import db_url
from tests.fault.harness import Cluster, P, PgBouncer

pytestmark = pytest.mark.fault
T = TaskState


SESSIONS = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND backend_type = 'client backend'")


@contextmanager
def peak_connections(database: str) -> Iterator[list[int]]:
    """Samples, every 50 ms, the client sessions open on ``database`` (from a session on another
    database, so the sampler is not counted); yields a list whose first item ends as the peak."""
    peak = [0]
    stop = threading.Event()
    engine = sa.create_engine(db_url("postgres"), poolclass=sa.pool.NullPool)

    def sample() -> None:
        with engine.connect() as conn:
            while not stop.is_set():
                n = conn.execute(SESSIONS, {"d": database}).scalar_one()
                peak[0] = max(peak[0], int(n))
                conn.commit()
                stop.wait(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join(10)
        engine.dispose()


def _fan_out(name: str, n: int, seconds: float) -> DAG:
    dag = DAG(name)
    root = dag.task("root", P + "noop")
    flaky = dag.task("flaky", P + "flaky", kwargs={"fail_times": 1}, max_attempts=3, backoff={"base": 0.2, "cap": 0.5})
    leaves = [
        dag.task(f"s{i}", P + "sleep", kwargs={"seconds": seconds}, upstream=[root], max_attempts=3) for i in range(n)
    ]
    dag.task("join", P + "echo", kwargs={"done": True}, upstream=[*leaves, flaky])
    return dag


def test_a_threads_worker_shares_a_few_connections(cluster: Cluster) -> None:
    # Given a worker with 32 threads, each process allowed 4 store and 4 hot-path connections
    cluster.configure(ORCHESTRATOR_DB_POOL_SIZE="4")
    database = sa.engine.make_url(cluster.database_url).database
    assert database
    with peak_connections(database) as peak:
        w = cluster.worker("threads", concurrency=32, pool="threads")
        # When 320 tasks of 50 ms run on it
        run = cluster.orc.submit(_fan_out("threads-share", 320, 0.05))
        # Then they all succeed with each task's outcome committed once
        assert cluster.wait_run(run.id, 120) is RunState.SUCCEEDED, w.tail()
    cluster.assert_clean([run.id])
    # and the database saw few sessions: the worker at most 3P + 1 (docs/operations.md: 4 hot-path,
    # 4 store + 4 overflow, the duty), this test's store 4 (one connection per thread before: 32
    # and more)
    assert peak[0] <= 3 * 4 + 1 + 4, f"{peak[0]} sessions on {database}"
    print(f"peak sessions with a 32-thread worker: {peak[0]}")


def test_a_deployment_through_pgbouncer_in_transaction_mode(cluster: Cluster) -> None:
    # Given PgBouncer in transaction mode with 4 server connections in front of the database, and
    # every process of the deployment on it (the reconciler's duty lock straight to Postgres)
    bouncer = PgBouncer(cluster.database_url, pool_size=4)
    bouncer.start()
    try:
        cluster.configure(
            ORCHESTRATOR_DATABASE_URL=bouncer.url,
            ORCHESTRATOR_DB_TRANSACTION_POOLER="1",
            ORCHESTRATOR_DB_DIRECT_URL=cluster.database_url,
        )
        database = sa.engine.make_url(cluster.database_url).database
        assert database
        with peak_connections(database) as peak:
            w1 = cluster.worker("pgb1", concurrency=16, pool="threads")
            run = cluster.orc.submit(_fan_out("through-pgbouncer", 120, 0.3))
            cluster.wait_for(lambda: cluster.store.reads.reconciler_on_duty(), 20, "a reconciler on duty")
            # When the worker is killed -9 while tasks run, and another takes its place
            cluster.wait_for(
                lambda: sum(1 for t in run.tasks() if t.state is T.SUCCEEDED) >= 20, 60, "20 tasks done", run_id=run.id
            )
            w1.signal_group(signal.SIGKILL)
            w1.popen.wait(10)
            cluster.restore_unacked()  # the broker's visibility timeout, passed at once
            cluster.worker("pgb2", concurrency=16, pool="threads")
            # Then the run succeeds: nothing lost, no outcome committed twice
            assert cluster.wait_run(run.id, 120) is RunState.SUCCEEDED, cluster.tails() + bouncer.log()
        cluster.assert_clean([run.id])
        # and Postgres saw PgBouncer's 4 server connections and the duty's own, never more
        assert peak[0] <= 5, f"{peak[0]} sessions on {database}"
        # the killed worker's duty ended with its process: the second worker's reconciler holds it
        assert any("pgb2" in label for label in cluster.store.reads.reconciler_on_duty())
        print(f"peak sessions through PgBouncer: {peak[0]}")
    finally:
        cluster.close()  # the workers first: PgBouncer must outlive its clients
        bouncer.stop()


def test_group_commit_on_two_threads_workers_one_killed(cluster: Cluster) -> None:
    # Given two 16-thread workers whose threads commit their claims and outcomes in groups
    cluster.configure(ORCHESTRATOR_GROUP_COMMIT="1", ORCHESTRATOR_DB_POOL_SIZE="2")
    w1 = cluster.worker("group1", concurrency=16, pool="threads")
    cluster.worker("group2", concurrency=16, pool="threads")
    # When 400 tasks of 20-50 ms run on them (groups of the two processes meet on the run's rows
    # and on the fan-in's), and one worker is killed -9 mid-run
    run = cluster.orc.submit(_fan_out("group-commit", 400, 0.02))
    cluster.wait_for(
        lambda: sum(1 for t in run.tasks() if t.state is T.SUCCEEDED) >= 100, 60, "100 tasks done", run_id=run.id
    )
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.restore_unacked()
    # Then the run succeeds: nothing lost, no outcome committed twice
    assert cluster.wait_run(run.id, 180) is RunState.SUCCEEDED, cluster.tails()
    cluster.assert_clean([run.id])
    # and outcomes were committed in groups: ledger rows of one transaction share its now()
    with cluster.store.engine.connect() as conn:
        rows, stamps = conn.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT at) FROM orc_task_events"
                " WHERE run_id = :r AND to_state = 'SUCCEEDED' AND accepted AND key IS NOT NULL"
            ),
            {"r": run.id},
        ).one()
    assert rows == 403 and stamps < rows, (rows, stamps)
    print(f"group commit: {rows} successes in {stamps} transactions")
