"""Cancelling a wide map while a real prefork worker (``-c 2``) works through it (issue 36,
crossing 3): the cancel succeeds at its first try (no deadlock with the worker's completions,
nothing retried), the run ends CANCELLED with every task terminal, and nothing of it runs or is
dispatched after the cancel returned."""

from __future__ import annotations

import logging
import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.core.states import TERMINAL
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration
D = "tasks.dynamic."
#: the map's width: one insert window (dag.MAP_WINDOW), so the cancel finds 10,000 open rows
ITEMS = 10_000


def count(orc: Orchestrator, run_id: str, *where: sa.ColumnElement[bool]) -> int:
    with orc.store.engine.connect() as conn:
        q = sa.select(sa.func.count()).select_from(s.tasks).where(s.tasks.c.run_id == run_id, *where)
        return int(conn.execute(q).scalar_one())


def test_a_wide_map_is_cancelled_at_the_first_try_while_the_worker_runs_it(
    orc: Orchestrator, worker: WorkerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a 10,000-item map that the worker is working through
    caplog.set_level(logging.WARNING)
    dag = DAG("cancel-wide-map")
    ls = dag.task("ls", D + "listing", kwargs={"n": ITEMS})
    m = dag.map("m", D + "item", over=ls, kwarg="x", max_map_length=ITEMS)
    dag.task("join", D + "collect", upstream=[m])
    worker_deadlocks = worker.text().count("DeadlockDetected")
    run = orc.submit(dag)
    done = s.tasks.c.state == "SUCCEEDED"
    deadline = time.monotonic() + 180
    while count(orc, run.id, s.tasks.c.map_parent == "m", done) < 100:
        assert time.monotonic() < deadline, "the worker did not start on the map"
        assert run.state is RunState.RUNNING
        time.sleep(0.05)

    # When it is cancelled through the API while the worker's completions go on
    began = time.monotonic()
    revoked = orc.cancel(run.id, by="it")
    took = time.monotonic() - began
    with orc.store.engine.connect() as conn:
        mark = int(conn.execute(sa.select(sa.func.max(s.events.c.id))).scalar_one())

    # Then it succeeded at the first try: no deadlock here or in the worker, nothing retried
    assert [r.getMessage() for r in caplog.records if "Deadlock" in r.getMessage()] == []
    assert revoked >= 0
    assert run.state is RunState.CANCELLED
    assert count(orc, run.id, s.tasks.c.state.not_in([st.value for st in TERMINAL])) == 0
    # and the worker moves on to other work: the run it takes next is done, and by then nothing
    # of the cancelled run was claimed, succeeded or dispatched after the cancel returned
    after = DAG("after-the-cancel")
    after.task("a", D + "item", kwargs={"x": 1})
    assert orc.submit(after).wait(timeout=180).state is RunState.SUCCEEDED
    with orc.store.engine.connect() as conn:
        late = conn.execute(
            sa.select(s.events.c.key, s.events.c.from_state, s.events.c.to_state).where(
                s.events.c.run_id == run.id, s.events.c.id > mark, s.events.c.accepted.is_(True)
            )
        ).all()
    assert late == []
    assert worker.text().count("DeadlockDetected") == worker_deadlocks
    assert check_runs(orc.store, [run.id]) == []
    succeeded = count(orc, run.id, s.tasks.c.map_parent == "m", done)
    print(f"cancelled a {ITEMS}-item map ({succeeded} done, {revoked} revoked) in {took:.2f}s")
