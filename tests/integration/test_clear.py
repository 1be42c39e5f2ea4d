"""Clear, mark and rerun end to end: a real prefork worker runs the tasks, an operator acts
through the real CLI (``orchestrator clear / mark / rerun / verify`` as subprocesses), and the
runs end as the operator meant, with the database's invariants holding."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState, TaskState, TriggerRule
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s
from tests.integration.conftest import ROOT, WorkerProcess

T = TaskState
pytestmark = pytest.mark.integration
D = "tasks.dynamic."
P = "tasks.probes."


def cli(*args: str) -> str:
    """``orchestrator ARGS`` as an operator runs it (the test session's settings): its output,
    printed for the record; fails the test on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(f"$ orchestrator {' '.join(args)}\n{done.stdout}{done.stderr}", end="")
    assert done.returncode == 0, (args, done.returncode, done.stdout, done.stderr)
    return done.stdout.strip()


def states(run: Any) -> dict[str, TaskState]:
    return {t.key: t.state for t in run.tasks()}


def ran(run: Any) -> Counter[tuple[str, int]]:
    """Accepted claims (-> RUNNING) per (key, attempt)."""
    return Counter((e.key, e.attempt) for e in run.events() if e.key and e.accepted and e.to_state == "RUNNING")


def successes(run: Any) -> Counter[tuple[str, int]]:
    return Counter((e.key, e.attempt) for e in run.events() if e.key and e.accepted and e.to_state == "SUCCEEDED")


def pipeline(flag: Path) -> DAG:
    """extract -> transform (fails until ``flag`` exists) -> load -> report (all_done)."""
    dag = DAG("clear-pipeline")
    extract = dag.task("extract", P + "noop")
    transform = dag.task("transform", D + "gated", kwargs={"flag": str(flag)}, upstream=[extract])
    load = dag.task("load", D + "collect", upstream=[transform])
    dag.task("report", P + "noop", upstream=[load], trigger_rule=TriggerRule.ALL_DONE)
    return dag


def test_fail_dry_run_then_clear_downstream_and_rerun(orc: Orchestrator, worker: WorkerProcess, tmp_path: Path) -> None:
    # Given a pipeline whose transform fails: load is UPSTREAM_FAILED, report (all_done) ran, the run FAILED
    flag = tmp_path / "fixed"
    run = orc.submit(pipeline(flag))
    assert run.wait(timeout=60).state is RunState.FAILED
    assert states(run) == {"extract": T.SUCCEEDED, "transform": T.FAILED, "load": T.UPSTREAM_FAILED,
                           "report": T.SUCCEEDED}  # fmt: skip
    assert "GateClosed" in (run.task("transform").error or "")

    # When an operator asks what a clear from extract down would do
    events, attempts = len(run.events()), {t.key: t.attempt for t in run.tasks()}
    out = cli("clear", run.id, "extract", "--downstream", "--dry-run")
    # Then it lists the four tasks and changes nothing
    assert out == f"{run.id}: would clear 4 task(s): extract, load, report, transform"
    assert len(run.events()) == events and {t.key: t.attempt for t in run.tasks()} == attempts
    assert run.state is RunState.FAILED and states(run)["transform"] is T.FAILED
    out = cli("clear", run.id, "extract", "--downstream", "--only-failed", "--dry-run")
    assert out == f"{run.id}: would clear 2 task(s): load, transform"
    assert len(run.events()) == events

    # When the bug is fixed and transform is cleared with its downstream
    flag.write_text("fixed")
    out = cli("clear", run.id, "transform", "--downstream")
    assert out == f"{run.id}: cleared 3 task(s): load, report, transform"

    # Then the run reopens and reaches SUCCEEDED, transform on attempt 2, load with its result
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert set(states(run).values()) == {T.SUCCEEDED}
    transform = run.task("transform")
    assert transform.attempt == 2 and transform.result["attempt"] == 2
    assert run.task("load").result == {"transform": transform.result}
    assert ran(run) == Counter({("extract", 1): 1, ("transform", 1): 1, ("transform", 2): 1, ("load", 2): 1,
                                ("report", 1): 1, ("report", 2): 1})  # fmt: skip
    # one accepted result per generation: report's first (before the clear) and its second
    assert successes(run) == Counter({("extract", 1): 1, ("transform", 2): 1, ("load", 2): 1, ("report", 1): 1,
                                      ("report", 2): 1})  # fmt: skip
    clears = [e for e in run.events() if e.accepted and e.actor == "operator" and e.to_state == "PENDING"]
    assert {e.key for e in clears} == {"transform", "load", "report"}
    assert all((e.by or "").endswith("(cli)") for e in clears), [e.by for e in clears]
    reopened = [e for e in run.events() if e.key is None and e.from_state == "FAILED" and e.to_state == "RUNNING"]
    assert len(reopened) == 1

    # When the run is rerun
    new_id = cli("rerun", run.id)
    rerun = orc.run(new_id)
    # Then a new run, linked to it, runs the same DAG (the flag is there now) to SUCCEEDED
    assert new_id != run.id
    assert rerun.wait(timeout=60).state is RunState.SUCCEEDED
    assert set(states(rerun).values()) == {T.SUCCEEDED} and rerun.task("transform").attempt == 1
    with orc.store.engine.connect() as conn:
        linked = conn.execute(sa.select(s.runs.c.rerun_of).where(s.runs.c.id == new_id)).scalar_one()
    assert linked == run.id

    assert check_runs(orc.store, [run.id, rerun.id]) == []
    assert cli("verify", run.id, rerun.id) == "2 run(s) checked: no violation"


def test_mark_success_on_a_failed_task_lets_its_children_run(
    orc: Orchestrator, worker: WorkerProcess, tmp_path: Path
) -> None:
    # Given a -> b -> c where a fails (its flag never exists): b and c UPSTREAM_FAILED, the run FAILED
    dag = DAG("mark-success")
    a = dag.task("a", D + "gated", kwargs={"flag": str(tmp_path / "never")})
    b = dag.task("b", D + "collect", upstream=[a])
    dag.task("c", P + "noop", upstream=[b])
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.FAILED
    assert states(run) == {"a": T.FAILED, "b": T.UPSTREAM_FAILED, "c": T.UPSTREAM_FAILED}

    # When an operator marks a SUCCEEDED by hand
    assert cli("mark", run.id, "a", "--success") == f"{run.id}.a: FAILED -> SUCCEEDED"

    # Then b and c are decided again and run, a is not run again, and the run SUCCEEDED
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert states(run) == {"a": T.SUCCEEDED, "b": T.SUCCEEDED, "c": T.SUCCEEDED}
    assert ran(run) == Counter({("a", 1): 1, ("b", 1): 1, ("c", 1): 1})
    marked = [e for e in run.events() if e.key == "a" and e.accepted and e.to_state == "SUCCEEDED"]
    assert len(marked) == 1 and marked[0].actor == "operator" and "by hand" in (marked[0].reason or "")
    assert check_runs(orc.store, [run.id]) == []
    assert cli("verify", run.id) == "1 run(s) checked: no violation"
