"""``async def`` task bodies (``orchestrator/runtime/aio.py``, ``tasks/aio.py``) on real workers, one
per pool (prefork, threads, solo), each on a queue of its own: an async DAG passes results through
``upstream``, each worker thread keeping its loop across bodies; a soft time limit cancels the
coroutine and FAILS the attempt with ``SoftTimeLimitExceeded`` (the pool's SIGUSR1 in prefork, the
loop's own timer in the threads and solo pools), a hard one stops a body that caught it
(``TimeLimitExceeded``); a cancel of the run cancels the coroutine, whose
``except asyncio.CancelledError`` runs once, and fences its attempt (its late outcome rejected,
nothing committed after the cancel); ``delay()`` without the orchestrator's headers runs the
coroutine and Celery logs its result."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import tasks.aio  # registers the async tasks on this process's app (for submit's checks)
from orchestrator import DAG, Orchestrator, RunState
from orchestrator.store.schema import events as ev
from orchestrator.store.schema import tasks as t
from orchestrator.store.schema import workers as w
from tests.conftest import DATA_DIR, IT_BROKER_URL
from tests.integration.conftest import sql, start_worker, stop_process, until

pytestmark = pytest.mark.integration

A = "tasks.aio."
POOLS = ("prefork", "threads", "solo")
MODULES = "tasks.probes,tasks.etl,tasks.dynamic,tasks.aio"


class Worker:
    def __init__(self, pool: str, queue: str, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.pool, self.queue, self.name, self.proc, self.log = pool, queue, name, proc, log

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def workers(orc: Orchestrator) -> Iterator[dict[str, Worker]]:
    """A worker per pool (``-c 2``; solo runs one at a time) with ``tasks.aio``, on its own queue,
    started together and waited for until its registry row is written; stopped by process group."""
    tag = uuid.uuid4().hex[:6]
    env = {**os.environ, "ORCHESTRATOR_TASK_MODULES": MODULES}
    started: dict[str, Worker] = {}
    try:
        for pool in POOLS:
            name, queue = f"aio-{pool}-{tag}@{socket.gethostname()}", f"it-aio-{pool}-{tag}"
            log = Path(DATA_DIR) / f"aio-{pool}.log"
            proc = start_worker(log, "--pool", pool, "-c", "2", "-Q", queue, "-n", name, env=env)
            started[pool] = Worker(pool, queue, name, proc, log)
        for wk in started.values():
            until(
                f"worker {wk.name} registered",
                lambda wk=wk: wk.proc.poll() is not None or sql(orc, sa.select(w.c.name).where(w.c.name == wk.name)),
            )
            assert wk.proc.poll() is None, wk.text()[-3000:]
        yield started
    finally:
        for wk in started.values():
            stop_process(wk.proc)


@pytest.fixture(params=POOLS)
def worker(request: pytest.FixtureRequest, workers: dict[str, Worker]) -> Worker:
    return workers[request.param]


@pytest.fixture(scope="module")
def notes() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(IT_BROKER_URL)
    try:
        yield client
    finally:
        client.close()


def noted(client: redis.Redis, marker: str) -> list[str]:
    return [x.decode() for x in client.lrange(f"orchestrator:aio:{marker}", 0, -1)]


def task_row(orc: Orchestrator, run_id: str, key: str) -> Any:
    return sql(orc, sa.select(t).where(t.c.run_id == run_id, t.c.key == key))[0]


def ledger(orc: Orchestrator, run_id: str, key: str) -> list[Any]:
    q = sa.select(ev.c.id, ev.c.from_state, ev.c.to_state, ev.c.accepted, ev.c.reason)
    return sql(orc, q.where(ev.c.run_id == run_id, ev.c.key == key).order_by(ev.c.id))


def test_an_async_dag_passes_results_through_upstream(orc: Orchestrator, worker: Worker) -> None:
    # Given an async DAG: two coroutine bodies, a third summing them through `upstream`, and a
    # few more that say which loop ran them
    dag = DAG(f"aio-dag-{worker.pool}")
    a = dag.task("a", A + "number", kwargs={"n": 2}, queue=worker.queue)
    b = dag.task("b", A + "number", kwargs={"n": 3}, queue=worker.queue)
    dag.task("total", A + "add_up", upstream=[a, b], kwargs={"plus": 10}, queue=worker.queue)
    for i in range(6):
        dag.task(f"where{i}", A + "whereami", upstream=[a], queue=worker.queue)

    # When it runs
    view = orc.submit(dag).wait(timeout=60)

    # Then every coroutine ran to its result, `current_context()` inside the coroutine included
    assert view.state is RunState.SUCCEEDED, [(x.key, x.state, x.error) for x in orc.run(view.id).tasks()]
    results = orc.run(view.id).results()
    assert results["a"] == 2 and results["b"] == 3
    assert results["total"]["total"] == 15 and results["total"]["attempt"] == 1
    # and each thread of each process kept one loop for all the bodies it ran
    loops: dict[tuple[int, int], set[int]] = {}
    for where in [results[f"where{i}"] for i in range(6)] + [results["total"]["where"]]:
        loops.setdefault((where["pid"], where["thread"]), set()).add(where["loop"])
    assert all(len(ids) == 1 for ids in loops.values()), loops
    assert len(loops) <= 2, loops  # -c 2 (solo: 1)


def test_a_soft_time_limit_cancels_the_coroutine_and_fails_the_attempt(
    orc: Orchestrator, worker: Worker, notes: redis.Redis
) -> None:
    # Given an async body that awaits forever, with a 1 s soft time limit and no retry
    marker = f"soft-{worker.pool}-{uuid.uuid4().hex[:6]}"
    dag = DAG(f"aio-soft-{worker.pool}")
    dag.task("stuck", A + "forever", kwargs={"marker": marker}, soft_time_limit=1, time_limit=60, queue=worker.queue)

    # When it runs past its soft limit
    run = orc.submit(dag)
    until("the attempt FAILED", lambda: task_row(orc, run.id, "stuck").state == "FAILED")

    # Then the attempt failed with SoftTimeLimitExceeded, once the coroutine's clean-up ran
    row = task_row(orc, run.id, "stuck")
    assert row.error.startswith("SoftTimeLimitExceeded"), row.error
    assert noted(notes, marker) == ["started", "cancelled SoftTimeLimitExceeded", "finally"]
    assert run.wait(timeout=30).state is RunState.FAILED
    if worker.pool == "prefork":  # the pool's SIGUSR1 did it (the loop's timer says its seconds)
        assert f"forever[{run.id}.stuck.1] raised unexpected: SoftTimeLimitExceeded()\n" in worker.text()


def test_a_body_that_outlives_its_soft_limit_is_stopped_at_the_hard_one(
    orc: Orchestrator, worker: Worker, notes: redis.Redis
) -> None:
    # Given an async body that catches its soft limit's cancel and goes on awaiting
    marker = f"hard-{worker.pool}-{uuid.uuid4().hex[:6]}"
    dag = DAG(f"aio-hard-{worker.pool}")
    dag.task("stuck", A + "stubborn", kwargs={"marker": marker}, soft_time_limit=1, time_limit=3, queue=worker.queue)

    # When it runs past its hard limit
    run = orc.submit(dag)
    until("the attempt FAILED", lambda: task_row(orc, run.id, "stuck").state == "FAILED")

    # Then the attempt failed with TimeLimitExceeded: recorded by the prefork worker's main process
    # as its pool kills the body (SIGTERM, routed to a cancel, then SIGKILL 0.1 s later), by the
    # loop's own timer elsewhere, which cancels the body a second time
    row = task_row(orc, run.id, "stuck")
    # "TimeLimitExceeded: hard time limit (...)" on every pool: from prefork's main process, or
    # the body's own exception described as that
    assert row.error.startswith("TimeLimitExceeded: hard time limit ("), row.error
    got = noted(notes, marker)
    assert got[:2] == ["started", "ignored SoftTimeLimitExceeded"], got
    if worker.pool == "prefork":
        assert got[2:] in ([], ["cancelled SystemExit"]), got
    else:
        assert got[2:] == ["cancelled TimeLimitExceeded"], got


def test_a_cancelled_run_cancels_its_coroutine_and_fences_its_attempt(
    orc: Orchestrator, worker: Worker, notes: redis.Redis
) -> None:
    # Given an async body that awaits forever, running
    marker = f"cancel-{worker.pool}-{uuid.uuid4().hex[:6]}"
    dag = DAG(f"aio-cancel-{worker.pool}")
    dag.task("stuck", A + "forever", kwargs={"marker": marker}, queue=worker.queue)
    run = orc.submit(dag)
    until("running", lambda: task_row(orc, run.id, "stuck").state == "RUNNING")
    until("the coroutine awaits", lambda: noted(notes, marker) == ["started"])

    # When its run is cancelled (a revoke with terminate; the heartbeat then finds the lease gone)
    orc.cancel(run.id, by="it")

    # Then the coroutine is cancelled: its except and finally ran, once
    got = until("the coroutine cancelled", lambda: (n := noted(notes, marker))[-1:] == ["finally"] and n)
    assert got[0] == "started" and got[2] == "finally" and len(got) == 3, got
    # by the terminate signal (prefork) or the lost lease (threads and solo cannot terminate a body)
    assert got[1] in ("cancelled SystemExit", "cancelled LeaseLost"), got
    # and the attempt is fenced: its late outcome is refused (a rejected row), nothing after the
    # cancel was accepted, and its one claim is the only RUNNING it ever had
    until("the late outcome refused", lambda: any(not e.accepted for e in ledger(orc, run.id, "stuck")))
    events = ledger(orc, run.id, "stuck")
    accepted = [(e.from_state, e.to_state) for e in events if e.accepted]
    assert accepted[-1] == ("RUNNING", "CANCELLED"), events
    assert [to for _, to in accepted].count("RUNNING") == 1, events
    assert not {"SUCCEEDED", "FAILED", "RETRYING"} & {to for _, to in accepted}, events
    assert task_row(orc, run.id, "stuck").state == "CANCELLED"
    assert run.status().state is RunState.CANCELLED


def test_a_plain_celery_message_runs_the_coroutine(worker: Worker, notes: redis.Redis) -> None:
    # Given the same async task sent as a plain Celery message (no orchestrator headers)
    marker = f"plain-{worker.pool}-{uuid.uuid4().hex[:6]}"
    sent = tasks.aio.remember.apply_async(args=(marker, 20, 22), queue=worker.queue)

    # Then the worker ran the coroutine to its result, and Celery logged that result
    until("the coroutine ran", lambda: noted(notes, marker) == ["result 42"])
    line = re.compile(rf"Task tasks\.aio\.remember\[{sent.id}\] succeeded in [0-9.e-]+s: 42$", re.M)
    until("celery logged its result", lambda: line.search(worker.text()))
    assert "was never awaited" not in worker.text()
