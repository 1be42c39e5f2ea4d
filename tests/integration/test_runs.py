"""End to end: submit -> Postgres -> Redis -> a real prefork Celery worker -> results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState, TaskState, TriggerRule
from orchestrator.core.protocol import HEADER_ATTEMPT, HEADER_KEY, HEADER_RUN, HEADER_SIGNATURE, FencingToken, sign
from orchestrator.engine.scope import local_by
from orchestrator.store import schema as s
from tests.integration.conftest import ROOT, WorkerProcess, start_worker, stop_process

T = TaskState
pytestmark = pytest.mark.integration
P = "tasks.probes."


def states(run: object) -> dict[str, TaskState]:
    return {t.key: t.state for t in run.tasks()}  # type: ignore[attr-defined]


def one_accepted_outcome_per_task(orc: Orchestrator, run_id: str) -> None:
    """Every task has at most one accepted terminal event per attempt and one result."""
    with orc.store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(s.events.c.key, s.events.c.attempt, sa.func.count())
            .where(
                s.events.c.run_id == run_id,
                s.events.c.accepted.is_(True),
                s.events.c.to_state.in_(["SUCCEEDED", "FAILED", "RETRYING"]),
            )
            .group_by(s.events.c.key, s.events.c.attempt)
        ).all()
    assert all(n == 1 for _, _, n in rows), rows


def test_chain_passes_results_downstream(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("chain", tenant="acme")
    prev = dag.task("n0", P + "echo", kwargs={"step": 0})
    for i in range(1, 5):
        prev = dag.task(f"n{i}", P + "echo", kwargs={"step": i}, upstream=[prev])
    run = orc.submit(dag)
    view = run.wait(timeout=60)
    assert view.state is RunState.SUCCEEDED
    last = run.task("n4").result
    assert last["kwargs"] == {"step": 4} and last["upstream"]["n3"]["kwargs"] == {"step": 3}
    tasks = {t.key: t for t in run.tasks()}
    for i in range(1, 5):  # parents finish before children start
        assert tasks[f"n{i - 1}"].finished_at <= tasks[f"n{i}"].started_at  # type: ignore[operator]
    one_accepted_outcome_per_task(orc, run.id)


def test_fan_out_fan_in_and_diamond(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("fan")
    root = dag.task("root", P + "noop")
    mids = [dag.task(f"m{i}", P + "echo", kwargs={"i": i}, upstream=[root]) for i in range(20)]
    dag.task("sink", P + "echo", upstream=mids)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert sorted(run.task("sink").result["upstream"]) == sorted(m.key for m in mids)

    d = DAG("diamond")
    a = d.task("a", P + "echo", kwargs={"v": "a"})
    b = d.task("b", P + "echo", upstream=[a])
    c = d.task("c", P + "echo", upstream=[a])
    d.task("d", P + "echo", upstream=[b, c])
    run = orc.submit(d)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert set(run.task("d").result["upstream"]) == {"b", "c"}


def test_every_trigger_rule(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("rules")
    ok = dag.task("ok", P + "noop")
    bad = dag.task("bad", P + "fail", kwargs={"message": "expected"})
    bad2 = dag.task("bad2", P + "fail")
    dag.task("all_success", P + "noop", upstream=[ok, bad])
    dag.task("all_done", P + "noop", upstream=[ok, bad], trigger_rule=TriggerRule.ALL_DONE)
    dag.task("one_success", P + "noop", upstream=[ok, bad], trigger_rule=TriggerRule.ONE_SUCCESS)
    dag.task("one_failed", P + "noop", upstream=[ok, bad], trigger_rule=TriggerRule.ONE_FAILED)
    skipped = dag.task("one_failed_none", P + "noop", upstream=[ok], trigger_rule=TriggerRule.ONE_FAILED)
    dag.task("none_failed", P + "noop", upstream=[ok, bad], trigger_rule=TriggerRule.NONE_FAILED)
    dag.task("none_failed_skip", P + "noop", upstream=[ok, skipped], trigger_rule=TriggerRule.NONE_FAILED)
    dag.task("all_failed", P + "noop", upstream=[bad, bad2], trigger_rule=TriggerRule.ALL_FAILED)
    dag.task("all_failed_not", P + "noop", upstream=[ok, bad], trigger_rule=TriggerRule.ALL_FAILED)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.FAILED
    assert states(run) == {
        "ok": T.SUCCEEDED,
        "bad": T.FAILED,
        "bad2": T.FAILED,
        "all_success": T.UPSTREAM_FAILED,
        "all_done": T.SUCCEEDED,
        "one_success": T.SUCCEEDED,
        "one_failed": T.SUCCEEDED,
        "one_failed_none": T.SKIPPED,
        "none_failed": T.UPSTREAM_FAILED,
        "none_failed_skip": T.SUCCEEDED,
        "all_failed": T.SUCCEEDED,
        "all_failed_not": T.SKIPPED,
    }
    assert "expected" in (run.task("bad").error or "")


def test_flaky_task_retries_with_backoff(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("flaky")
    dag.task("f", P + "flaky", kwargs={"fail_times": 2}, max_attempts=3, backoff={"base": 0.2, "cap": 0.5})
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    task = run.task("f")
    assert task.attempt == 3 and task.result == 3
    retries = [e for e in run.events() if e.to_state == "RETRYING" and e.accepted]
    assert [e.attempt for e in retries] == [1, 2]
    assert "FlakyError" in (retries[0].reason or "") and "FlakyTimeout" in (retries[1].reason or "")
    one_accepted_outcome_per_task(orc, run.id)


def test_failure_cascades_and_run_fails(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("cascade")
    a = dag.task("a", P + "fail")
    b = dag.task("b", P + "noop", upstream=[a])
    dag.task("c", P + "noop", upstream=[b])
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.FAILED
    assert states(run) == {"a": T.FAILED, "b": T.UPSTREAM_FAILED, "c": T.UPSTREAM_FAILED}
    assert run.task("a").attempt == 1


def test_time_limits_count_as_failures(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("limits")
    dag.task("soft", P + "hang", soft_time_limit=1, time_limit=5)
    dag.task("hard", P + "hang", time_limit=2)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.FAILED
    assert "SoftTimeLimitExceeded" in (run.task("soft").error or "")
    assert "TimeLimitExceeded" in (run.task("hard").error or "")
    after = DAG("after-limits")
    after.task("x", P + "noop")
    assert orc.submit(after).wait(timeout=30).state is RunState.SUCCEEDED  # the pool recovered


def test_idempotent_submit(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("idem", tenant="acme")
    dag.task("a", P + "noop")
    first = orc.submit(dag, idempotency_key="revenue:2026-04-25")
    second = orc.submit(dag, idempotency_key="revenue:2026-04-25")
    assert first.id == second.id
    with orc.store.engine.connect() as conn:
        n = conn.execute(
            sa.select(sa.func.count()).where(s.runs.c.idempotency_key == "revenue:2026-04-25")
        ).scalar_one()
    assert n == 1
    assert first.wait(timeout=30).state is RunState.SUCCEEDED


def test_two_thousand_node_dag(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("wide")
    root = dag.task("root", P + "noop")
    mids = [dag.task(f"m{i}", P + "noop", upstream=[root]) for i in range(1998)]
    dag.task("sink", P + "noop", upstream=mids)
    run = orc.submit(dag)
    view = run.wait(timeout=240)
    assert view.state is RunState.SUCCEEDED and view.counts == {"SUCCEEDED": 2000}
    one_accepted_outcome_per_task(orc, run.id)


def test_bad_messages_are_dropped_and_recorded(orc: Orchestrator, worker: WorkerProcess) -> None:
    done = DAG("done")
    done.task("a", P + "echo", kwargs={"x": 1})
    run = orc.submit(done)
    assert run.wait(timeout=30).state is RunState.SUCCEEDED
    app = orc.app
    key = orc.store.signing_key

    def signed(run_id: str) -> dict[str, object]:
        token = FencingToken(run_id, "a", 1)
        return {**token.headers(), HEADER_SIGNATURE: sign(key, P + "echo", token)}

    # a stale attempt of a finished task (a duplicate of a real message: signed), an unknown
    # run, an unsigned message for a real task, garbled headers, pickle, an unregistered task
    app.send_task(
        P + "echo", kwargs={"x": 2}, queue="orchestrator.default", task_id=f"{run.id}.a.1", headers=signed(run.id)
    )
    app.send_task(P + "echo", queue="orchestrator.default", task_id="nope.a.1", headers=signed("nope"))
    app.send_task(
        P + "echo",
        queue="orchestrator.default",
        task_id="unsigned-1",
        headers={HEADER_RUN: run.id, HEADER_KEY: "a", HEADER_ATTEMPT: 1, HEADER_SIGNATURE: "0" * 64},
    )
    app.send_task(
        P + "echo",
        queue="orchestrator.default",
        task_id="garbled-1",
        headers={**signed(run.id), HEADER_ATTEMPT: "one"},
    )
    app.send_task(P + "echo", queue="orchestrator.default", task_id="pickled-1", serializer="pickle")
    app.send_task("os.system", args=["true"], queue="orchestrator.default", task_id="unregistered-1")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rejected = [e for e in run.events() if not e.accepted]
        log = worker.text()
        if rejected and all(
            t in log for t in ("garbled-1", "pickled-1", "unsigned-1", "os.system", "nope.a.1 refused")
        ):
            break
        time.sleep(0.2)
    assert [e.to_state for e in run.events() if not e.accepted] == ["RUNNING"]
    assert run.task("a").result == {"kwargs": {"x": 1}, "upstream": {}}  # nothing re-committed
    with orc.store.engine.connect() as conn:  # a message for no task leaves no ledger garbage
        garbage = conn.execute(sa.select(sa.func.count()).where(s.events.c.run_id == "nope")).scalar_one()
    assert garbage == 0
    assert "nope.a.1: no such task" in worker.text() or "nope.a.1 refused" in worker.text()
    log = worker.text()
    assert "dropping message unsigned-1 of tasks.probes.echo: the fencing headers' signature does not verify" in log
    assert "dropping message 'garbled-1' (task 'tasks.probes.echo')" in log and "attempt 'one'" in log
    assert "dropping message 'pickled-1'" in log and "only application/json is accepted" in log
    assert "Received unregistered task of type 'os.system'" in log
    # the worker is still healthy
    again = DAG("after-garbage")
    again.task("a", P + "noop")
    assert orc.submit(again).wait(timeout=30).state is RunState.SUCCEEDED
    assert worker.proc.poll() is None


def test_plain_celery_call_outside_a_dag(orc: Orchestrator, worker: WorkerProcess) -> None:
    from tasks.probes import echo

    assert echo(x=1) == {"kwargs": {"x": 1}, "upstream": {}}
    result = echo.apply_async(kwargs={"plain": True}, queue="orchestrator.default")
    deadline = time.monotonic() + 30
    while f"{result.id}] succeeded" not in worker.text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"{result.id}] succeeded" in worker.text()


def test_worker_refuses_short_visibility_timeout(tmp_path: Path, orc: Orchestrator) -> None:
    env = os.environ.copy()
    env.update({"ORCHESTRATOR_VISIBILITY_TIMEOUT": "100", "ORCHESTRATOR_MAX_TIME_LIMIT": "1800"})
    log = tmp_path / "refused.log"
    proc = start_worker(log, "-c", "1", env=env)
    try:
        assert proc.wait(60) != 0
    finally:
        stop_process(proc)
    assert "visibility_timeout 100s must exceed the longest hard time limit 1800s" in log.read_text()


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=cwd,
        env=env or os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_submit_status_runs(orc: Orchestrator, worker: WorkerProcess, tmp_path: Path) -> None:
    spec = tmp_path / "revenue.yaml"
    spec.write_text(
        "name: revenue\ntenant: acme\nnodes:\n"
        "  - {key: extract, task: tasks.probes.echo, kwargs: {day: '2026-04-25'}}\n"
        "  - {key: load, task: tasks.probes.echo, upstream: [extract]}\n"
    )
    done = cli("submit", str(spec), "--wait", "--timeout", "60", "--idempotency-key", "cli-1")
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.splitlines()[0]
    assert done.stdout.splitlines()[-1] == "SUCCEEDED"
    status = cli("status", run_id, "--json")
    payload = json.loads(status.stdout)
    assert payload["run"]["id"] == run_id and payload["run"]["state"] == "SUCCEEDED"
    assert payload["run"]["dag"] == "revenue" and payload["run"]["tenant"] == "acme"
    load = next(t for t in payload["tasks"] if t["key"] == "load")
    assert load["state"] == "SUCCEEDED" and load["attempt"] == 1 and load["started_at"] and load["finished_at"]
    assert load["result"]["upstream"]["extract"]["kwargs"] == {"day": "2026-04-25"}
    table = cli("status", run_id)
    assert "SUCCEEDED" in table.stdout and "extract" in table.stdout
    runs = json.loads(cli("runs", "--json").stdout)["runs"]
    assert any(r["id"] == run_id for r in runs)
    assert cli("submit", str(spec), "--idempotency-key", "cli-1").stdout.splitlines()[0] == run_id


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("name: x\nnodes:\n  - {key: a, task: os.system}\n", "node 'a': task 'os.system' is not registered"),
        (
            "name: x\nnodes:\n  - {key: a, task: tasks.probes.noop, upstream: [b]}\n"
            "  - {key: b, task: tasks.probes.noop, upstream: [a]}\n",
            "cycle",
        ),
        ("name: x\nnodes:\n  - {key: a, task: tasks.probes.noop, max_attempts: 0}\n", "max_attempts"),
        ("name: x\nnodes:\n  - {key: a, task: tasks.probes.noop, kwargs: {x: .inf}}\n", "not JSON"),
        ("name: x\nnodes: []\n", "no nodes"),
        ("name: x\nnodes:\n  - {key: a, task: tasks.probes.noop, trigger_rule: maybe}\n", "unknown trigger_rule"),
    ],
)
def test_cli_refuses_bad_specs_before_writing(orc: Orchestrator, tmp_path: Path, body: str, message: str) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(body)
    with orc.store.engine.connect() as conn:
        before = conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one()
    done = cli("submit", str(spec))
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and message in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one() == before


def test_cli_operator_conflicts_exit_non_zero_and_the_ledger_names_who(
    orc: Orchestrator, worker: WorkerProcess
) -> None:
    dag = DAG("cli-ops")
    dag.task("a", P + "echo")
    run = orc.submit(dag)
    assert run.wait(timeout=30).state is RunState.SUCCEEDED
    # a retry that does not apply to a SUCCEEDED task, and a cancel of a final run
    retry = cli("retry", run.id, "a")
    assert retry.returncode == 2 and retry.stderr.startswith("error: retry of"), retry.stderr
    assert "only DEAD_LETTER or FAILED" in retry.stderr and "Traceback" not in retry.stderr
    cancel = cli("cancel", run.id)
    assert cancel.returncode == 2 and "already SUCCEEDED" in cancel.stderr, cancel.stderr
    me = local_by("cli")
    refused = [(e.key, e.actor, e.by) for e in run.events() if not e.accepted]
    assert refused == [("a", "operator", me), (None, "operator", me)]
    ledger = json.loads(cli("events", run.id, "--json").stdout)["events"]
    assert ledger[0]["key"] is None and ledger[0]["to"] == "RUNNING" and ledger[0]["actor"] == "submit"
    assert {"key": None, "to": "SUCCEEDED", "actor": "worker"}.items() <= next(
        e for e in ledger if e["key"] is None and e["to"] == "SUCCEEDED"
    ).items()
    assert ledger[-1]["by"] == me and ledger[-1]["accepted"] is False
    runs = json.loads(cli("runs", "--json").stdout)["runs"]
    mine = next(r for r in runs if r["id"] == run.id)
    assert mine["counts"] == {"SUCCEEDED": 1} and mine["needs_attention"] is False
