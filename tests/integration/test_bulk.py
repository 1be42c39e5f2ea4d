"""Tags and bulk actions on a real prefork worker (issue 34): several tagged runs, some of which
fail; ``orchestrator bulk retry --tag ... --state FAILED`` (the command line, a process of its
own) retries exactly those, its ``--dry-run`` changes nothing (checked from the database), and
they end SUCCEEDED; a bulk cancel meets a run whose task is running on the worker (revoked, the
run CANCELLED, its late body never accepted) and skips the finished one; a bulk retry sends a task
parked in DEAD_LETTER back (attempt + 1) and its run succeeds."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s
from tests.integration.conftest import ROOT, WorkerProcess, sql, until

pytestmark = pytest.mark.integration
P = "tasks.probes."


def flaky(name: str = "bulk-flaky") -> DAG:
    """Fails its first attempt (max_attempts 1: the run ends FAILED), succeeds on the next."""
    dag = DAG(name)
    dag.task("work", P + "flaky", kwargs={"fail_times": 1})
    dag.task("after", P + "noop", upstream=["work"])
    return dag


def fine(name: str = "bulk-fine") -> DAG:
    dag = DAG(name)
    dag.task("work", P + "noop")
    return dag


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator ARGS`` in a process of its own (the test's environment: its database and
    broker), to its end."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def rows(orc: Orchestrator, run_ids: list[str]) -> tuple[list[Any], list[Any], int]:
    """What the database holds of the runs: runs (id, state), tasks (run, key, state, attempt) and
    the number of their ledger rows."""
    runs = sql(orc, sa.select(s.runs.c.id, s.runs.c.state).where(s.runs.c.id.in_(run_ids)).order_by(s.runs.c.id))
    tasks = sql(
        orc,
        sa.select(s.tasks.c.run_id, s.tasks.c.key, s.tasks.c.state, s.tasks.c.attempt)
        .where(s.tasks.c.run_id.in_(run_ids))
        .order_by(s.tasks.c.run_id, s.tasks.c.key),
    )
    events = sql(orc, sa.select(sa.func.count()).select_from(s.events).where(s.events.c.run_id.in_(run_ids)))
    return runs, tasks, int(events[0][0])


def final(orc: Orchestrator, run_ids: list[str]) -> bool:
    return all(orc.run_state(r).terminal for r in run_ids)


def test_bulk_retry_by_tag_retries_exactly_the_failed_runs_and_they_succeed(
    orc: Orchestrator, worker: WorkerProcess
) -> None:
    batch = uuid.uuid4().hex[:12]
    failing = [orc.submit(flaky(), tags={"batch": batch, "customer": "42"}).id for _ in range(3)]
    succeeding = [orc.submit(fine(), tags={"batch": batch, "customer": "42"}).id for _ in range(2)]
    elsewhere = orc.submit(flaky(), tags={"batch": batch, "customer": "7"}).id
    untagged = orc.submit(flaky()).id
    every = [*failing, *succeeding, elsewhere, untagged]
    until("every run final", lambda: final(orc, every), timeout=120)
    assert {orc.run_state(r) for r in failing} == {RunState.FAILED}
    assert {orc.run_state(r) for r in succeeding} == {RunState.SUCCEEDED}
    assert orc.run_state(elsewhere) is RunState.FAILED and orc.run_state(untagged) is RunState.FAILED

    # the dry run prints what would change and a count, and writes nothing
    before = rows(orc, every)
    filters = ["--tag", f"batch={batch}", "--tag", "customer=42"]
    dry = cli("bulk", "retry", *filters, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert sorted(line.split()[2] for line in lines if line.startswith("would retry")) == sorted(failing)
    assert sorted(line.split()[1] for line in lines if line.startswith("skipped")) == sorted(succeeding)
    assert lines[-1].startswith("bulk retry (dry run: nothing written): 3 run(s) would retry, 2 skipped, 0 failed")
    assert rows(orc, every) == before

    # the action retries exactly the FAILED runs of the filter
    others = [elsewhere, untagged, *succeeding]
    others_before = rows(orc, others)
    done = cli("bulk", "retry", *filters, "--state", "FAILED")
    assert done.returncode == 0, done.stderr
    assert sorted(line.split()[1] for line in done.stdout.splitlines() if line.startswith("retried")) == sorted(failing)
    assert "3 run(s) retried, 0 skipped, 0 failed, of 3 matching" in done.stdout
    until("the retried runs SUCCEEDED", lambda: {orc.run_state(r) for r in failing} == {RunState.SUCCEEDED}, 120)
    for run_id in failing:
        tasks = {t.key: (t.state.value, t.attempt) for t in orc.tasks(run_id)}
        assert tasks["work"] == ("SUCCEEDED", 2), tasks
        assert tasks["after"][0] == "SUCCEEDED"
        assert any(e.actor == "operator" and e.by and e.by.endswith("(cli)") for e in orc.ledger(run_id))
    # and nothing else changed: the other customer's, the untagged and the successful runs
    assert rows(orc, others) == others_before
    for run_id in (elsewhere, untagged):
        assert orc.run_state(run_id) is RunState.FAILED
        assert {t.attempt for t in orc.tasks(run_id)} == {1}
    assert {orc.run_state(r) for r in succeeding} == {RunState.SUCCEEDED}
    assert check_runs(orc.store, every, allow_dead_letter=False) == []


def test_bulk_cancel_meets_a_busy_run(orc: Orchestrator, worker: WorkerProcess) -> None:
    wave = uuid.uuid4().hex[:12]
    dag = DAG("bulk-busy")
    dag.task("long", P + "sleep", kwargs={"seconds": 120})
    dag.task("after", P + "noop", upstream=["long"])
    busy = orc.submit(dag, tags={"wave": wave}).id
    finished = orc.submit(fine(), tags={"wave": wave}).id
    running = (s.tasks.c.run_id == busy) & (s.tasks.c.key == "long") & (s.tasks.c.state == "RUNNING")
    until("the long task RUNNING on the worker", lambda: sql(orc, sa.select(s.tasks.c.key).where(running)))
    until("the other run SUCCEEDED", lambda: orc.run_state(finished) is RunState.SUCCEEDED)

    report = orc.bulk.cancel(tags={"wave": wave}, by="it")
    items = {i.run_id: i for i in report.items}
    assert (items[busy].outcome, items[busy].detail) == ("done", "cancelled; 1 running or queued task(s) revoked")
    assert (items[finished].outcome, items[finished].detail) == (
        "skipped",
        "run is SUCCEEDED: only a RUNNING run can be cancelled",
    )
    assert orc.run_state(busy) is RunState.CANCELLED
    assert {t.key: t.state.value for t in orc.tasks(busy)} == {"long": "CANCELLED", "after": "CANCELLED"}
    # the worker goes on with other work, and the cancelled task's body (revoked with terminate)
    # was never accepted
    assert orc.submit(fine()).wait(timeout=120).state is RunState.SUCCEEDED
    accepted = sql(
        orc,
        sa.select(s.events.c.to_state).where(
            s.events.c.run_id == busy, s.events.c.key == "long", s.events.c.accepted.is_(True)
        ),
    )
    assert "SUCCEEDED" not in {r[0] for r in accepted}
    assert check_runs(orc.store, [busy, finished]) == []


def test_bulk_retry_sends_a_dead_lettered_task_back_and_its_run_succeeds(
    orc: Orchestrator, worker: WorkerProcess
) -> None:
    lot = uuid.uuid4().hex[:12]
    dag = DAG("bulk-poisoned")
    # the same failure on attempts 1 and 2 (poison: DEAD_LETTER, the run RUNNING and needing a
    # person), a success from attempt 3 on: the operator's retry after the fix
    dag.task("work", P + "poisoned", kwargs={"until_attempt": 3}, max_attempts=5, backoff={"base": 0.01, "cap": 0.01})
    dag.task("after", P + "noop", upstream=["work"])
    run_id = orc.submit(dag, tags={"lot": lot}).id
    parked = (s.tasks.c.run_id == run_id) & (s.tasks.c.key == "work") & (s.tasks.c.state == "DEAD_LETTER")
    until("the task parked in DEAD_LETTER", lambda: sql(orc, sa.select(s.tasks.c.attempt).where(parked)), 120)
    assert orc.run_state(run_id) is RunState.RUNNING

    plan = orc.bulk.retry(tags={"lot": lot}, dry_run=True)
    assert [(i.run_id, i.outcome, i.detail) for i in plan.items] == [
        (run_id, "planned", "retry 1 DEAD_LETTER task(s): work")
    ]
    assert sql(orc, sa.select(s.tasks.c.attempt).where(parked)) == [(2,)]
    done = orc.bulk.retry(tags={"lot": lot}, state="RUNNING", by="it")
    assert [(i.run_id, i.outcome) for i in done.items] == [(run_id, "done")]
    until("the run SUCCEEDED", lambda: orc.run_state(run_id) is RunState.SUCCEEDED, 120)
    assert orc.task(run_id, "work").attempt == 3
    assert check_runs(orc.store, [run_id]) == []
