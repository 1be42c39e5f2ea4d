"""A task no live worker has registered (issue 36, crossing 2), end to end with real prefork
workers: worker A has every task module, worker B was started without ``tasks.dynamic``. A task
of ``tasks.dynamic`` routed to B's queue is held READY (nothing published), ``explain`` names the
task and the queue, the watchdog flags the run (``needs_attention``, its ``stuck`` ledger row);
a message B receives anyway (a worker row that says nothing of its tasks) is dropped by B and held,
never re-published in a loop; once a worker with the module starts, the run finishes SUCCEEDED."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.store.schema import events as ev
from orchestrator.store.schema import tasks as t
from tests.integration.conftest import OwnWorker, sql, stop_process, until

pytestmark = pytest.mark.integration

DISPATCH_TIMEOUT = 2.0
ALL_MODULES = "tasks.probes,tasks.etl,tasks.dynamic,tasks.canvas"


@pytest.fixture
def workers(own_worker: OwnWorker) -> OwnWorker:
    """A worker of the test's own on ``queue`` with ``ORCHESTRATOR_TASK_MODULES=modules``."""

    def start(tag: str, queue: str, modules: str) -> tuple[str, subprocess.Popen[bytes]]:
        return own_worker(
            tag, queue, ORCHESTRATOR_TASK_MODULES=modules, ORCHESTRATOR_DISPATCH_TIMEOUT=str(DISPATCH_TIMEOUT)
        )

    return start


def task_row(orc: Orchestrator, run_id: str, key: str) -> Any:
    return sql(orc, sa.select(t).where(t.c.run_id == run_id, t.c.key == key))[0]


def republished(orc: Orchestrator, run_id: str, key: str) -> int:
    found = sql(
        orc,
        sa.select(sa.func.count()).where(
            ev.c.run_id == run_id, ev.c.key == key, ev.c.from_state == "QUEUED", ev.c.to_state == "QUEUED",
            ev.c.accepted, ev.c.kind.is_(None),
        ),
    )  # fmt: skip
    return int(found[0][0])


def stuck_rows(orc: Orchestrator, run_id: str) -> list[Any]:
    return sql(orc, sa.select(ev.c.key, ev.c.reason).where(ev.c.run_id == run_id, ev.c.kind == "stuck"))


def test_a_task_no_live_worker_registered_is_held_then_runs_once_a_worker_has_it(
    orc: Orchestrator, workers: Callable[..., tuple[str, subprocess.Popen[bytes]]]
) -> None:
    tag = uuid.uuid4().hex[:6]
    qa, qb = f"it-watchdog-a-{tag}", f"it-watchdog-b-{tag}"
    # Given worker A with every task module on qa, and worker B without tasks.dynamic on qb
    workers(f"wd-a-{tag}", qa, ALL_MODULES)
    b, b_proc = workers(f"wd-b-{tag}", qb, "tasks.probes,tasks.etl")
    dag = DAG(f"it-watchdog-{tag}")
    dag.task("first", "tasks.probes.noop", queue=qa)
    dag.task("held", "tasks.dynamic.item", upstream=["first"], kwargs={"x": 1}, queue=qb)
    run = orc.submit(dag)

    # Then "first" runs on A, and "held" waits READY: nothing is published for it
    until("first done", lambda: task_row(orc, run.id, "first").state == "SUCCEEDED")
    until("held READY", lambda: task_row(orc, run.id, "held").state == "READY")
    reasons = {r.kind: r.detail for r in orc.explain(run.id, "held")[0].reasons}
    assert reasons.get("unregistered") == (
        f"no live worker on queue {qb} has task tasks.dynamic.item registered (workers on {qb}: {b})"
    ), reasons
    # the watchdog flags it: needs_attention, a ledger row with the alert's reason
    until("needs attention", lambda: run.status().needs_attention)
    flagged = stuck_rows(orc, run.id)
    assert [k for k, _ in flagged] == ["held"], flagged
    assert "no live worker on queue" in flagged[0][1]
    assert task_row(orc, run.id, "held").state == "READY"
    assert republished(orc, run.id, "held") == 0

    # When a message for it reaches B anyway (a worker row that says nothing of its tasks takes
    # every name), B drops it as unregistered: the task is held READY, not re-published
    fake = f"it-fake-{tag}"
    orc.register_worker(fake, [qb], 1)
    until("dropped by B", lambda: task_row(orc, run.id, "held").dropped_by == b)
    row = task_row(orc, run.id, "held")
    assert row.state == "READY"
    orc.unregister_worker(fake)
    # three dispatch timeouts of database time on, with the workers' reconciler passing each second
    (dropped_at,) = sql(orc, sa.select(sa.func.now()))[0]
    later = sa.text("SELECT now() > :at + make_interval(secs => :s)").bindparams(at=dropped_at, s=3 * DISPATCH_TIMEOUT)
    until("three dispatch timeouts", lambda: sql(orc, later)[0][0])
    assert task_row(orc, run.id, "held").state == "READY"
    assert republished(orc, run.id, "held") == 0
    reasons = {r.kind: r.detail for r in orc.explain(run.id, "held")[0].reasons}
    assert f"dropped by worker {b}" in reasons.get("unregistered", ""), reasons
    assert run.status().needs_attention

    # When B is gone and a worker with the module starts on qb, the run finishes on its own
    stop_process(b_proc)
    workers(f"wd-c-{tag}", qb, ALL_MODULES)
    until("run finished", lambda: run.status().state is RunState.SUCCEEDED)
    assert republished(orc, run.id, "held") == 0
    until("attention cleared", lambda: not run.status().needs_attention, timeout=30)
