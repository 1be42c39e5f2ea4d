"""Short database outages delay work, never decide it: a private Postgres is restarted mid-run
(every session dropped, the port refused for a while) under a real worker, with the default
``max_attempts=1`` and results being committed; the run still SUCCEEDS, each task once, and
``RunHandle.wait`` and ``orchestrator status`` wait the outage out."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import ROOT, Cluster, P
from tests.fault.pg import PrivatePostgres

pytestmark = pytest.mark.fault


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        pg.close()


def test_a_database_restart_mid_run_delays_but_loses_nothing(cluster: Cluster, private_pg: PrivatePostgres) -> None:
    cluster.configure(ORCHESTRATOR_DATABASE_URL=private_pg.url, ORCHESTRATOR_LEASE_SECONDS="15")
    migrated = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "db", "upgrade"],
        cwd=ROOT,
        env=cluster.env(),
        capture_output=True,
    )
    assert migrated.returncode == 0, migrated.stderr
    worker = cluster.worker("w1", concurrency=2)
    dag = DAG("outage")
    prev = None
    for i in range(12):  # a chain of short tasks: some commit while the server is down
        prev = dag.task(f"t{i:02d}", P + "sleep", kwargs={"seconds": 0.25}, upstream=[prev] if prev else [])
    run = cluster.orc.submit(dag)
    cluster.wait_task(run.id, "t02", lambda t: t.state is TaskState.RUNNING, 30, "the chain under way")
    # the application waits on the run through the outage (RunHandle.wait rides it out)
    waited: dict[str, object] = {}

    def wait() -> None:
        try:
            waited["view"] = run.wait(timeout=120, poll=0.2)
        except Exception as exc:  # noqa: BLE001 - the test reports it below
            waited["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    started = time.monotonic()
    restart = threading.Thread(target=private_pg.restart, kwargs={"down_for": 3.0})
    restart.start()
    time.sleep(1.0)  # the server is down: the command line waits it out too
    status = cluster.cli("status", run.id)
    restart.join(60)
    waiter.join(150)
    assert status.returncode == 0 and f"run {run.id}" in status.stdout, status.stderr
    assert "database unreachable or busy" in status.stderr  # it said it was waiting
    assert "error" not in waited, waited
    view = waited["view"]
    assert view.state is RunState.SUCCEEDED, (view, worker.tail())  # type: ignore[attr-defined]
    assert time.monotonic() - started < 120
    tasks = cluster.store.reads.get_tasks(run.id)
    assert {t.state for t in tasks} == {TaskState.SUCCEEDED}
    assert all(t.attempt == 1 for t in tasks), [(t.key, t.attempt) for t in tasks]
    assert worker.popen.poll() is None, worker.tail()
