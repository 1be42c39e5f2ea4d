"""A Celery canvas submitted as it is: the same task bodies (``tasks/canvas.py``) under plain
Celery (a worker with a result backend, its own broker database and deployment) and under
``orchestrator.submit(canvas)`` (real worker subprocesses) give the same results, the error
callback (``link_error``) included; the converted keys work with ``explain`` and ``clear``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.core.errors import ValidationError
from orchestrator.core.routing import default_queues
from tasks.canvas import extract, stamp, transform, workflow
from tests import conftest
from tests.conftest import DATA_DIR, IT_BROKER_URL, REDIS_BASE, ensure_database, reset_schema
from tests.integration.conftest import ROOT, start_worker, stop_process, until, wait_until_ready

DAY = "2026-11-28"
QUEUE = "canvas-io"
QUEUES = ",".join([QUEUE, *default_queues()])
#: a broker database of its own for the plain Celery deployment (no orchestrated worker reads it)
PLAIN_BROKER = f"{REDIS_BASE}/{int(IT_BROKER_URL.rsplit('/', 1)[1]) + 1}"


@pytest.fixture(scope="module")
def plain_env() -> Iterator[dict[str, str]]:
    """A plain Celery deployment: its own broker and database, a result backend, and a worker."""
    db = conftest.test_database("orchestrator_plain")
    url = ensure_database(db)
    reset_schema(url)
    env = {
        **os.environ,
        "ORCHESTRATOR_DATABASE_URL": url,
        "ORCHESTRATOR_BROKER_URL": PLAIN_BROKER,
        "PLAIN_RESULT_BACKEND": PLAIN_BROKER,
        "ORCHESTRATOR_WORKER_RECONCILER": "false",
    }
    log = Path(DATA_DIR) / "plain-worker.log"
    name = f"plain-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.plain_celery", "worker", "--pool", "prefork",
           "-c", "2", "--without-gossip", "--without-mingle", "-n", name, "-Q", QUEUES,
           "--loglevel", "INFO"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield env
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def canvas_worker(orc: Orchestrator) -> Iterator[None]:
    """An orchestrated worker that also consumes the canvas's queue."""
    log = Path(DATA_DIR) / "canvas-worker.log"
    name = f"canvas-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    proc = start_worker(log, "-c", "2", "-n", name, "-Q", QUEUES)
    try:
        wait_until_ready(orc, proc, log)
        yield
    finally:
        stop_process(proc)


def plain(env: dict[str, str], failures: Path, fail: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.plain_celery", DAY, str(failures), "1" if fail else "0", QUEUE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def finished(orc: Orchestrator, run_id: str) -> Any:
    return orc.run(run_id).wait(timeout=180)


def results(orc: Orchestrator, run_id: str) -> dict[str, Any]:
    return {t.key: t.result for t in orc.tasks(run_id)}


def lines(path: Path) -> list[dict[str, Any]]:
    found = until(f"{path} written", lambda: path.exists() and path.read_text().strip())
    return [json.loads(line) for line in found.splitlines()]


def test_a_canvas_gives_the_same_results_under_plain_celery_and_the_orchestrator(
    orc: Orchestrator, canvas_worker: None, plain_env: dict[str, str], tmp_path: Path
) -> None:
    expected = plain(plain_env, tmp_path / "plain-failures", fail=False)
    assert expected["stamp"] == "stamped done"
    assert expected["aggregate"]["order"] == [0, 1, 2, 3]

    run = orc.submit(workflow(DAY, failures=str(tmp_path / "orc-failures"), queue=QUEUE))
    status = finished(orc, run.id)
    assert status.state is RunState.SUCCEEDED, status
    got = results(orc, run.id)
    assert {k: got[k] for k in ("stamp", "load", "aggregate")} == expected
    # the keys are readable, the group's parts indexed, the error callbacks skipped (nothing failed)
    assert [f"transform[{i}]" for i in range(4)] == sorted(k for k in got if k.startswith("transform"))
    tasks = {t.key: t for t in orc.tasks(run.id)}
    assert tasks["extract"].queue == QUEUE
    assert {t.state.value for k, t in tasks.items() if k.startswith("notify_failure")} == {"SKIPPED"}
    assert not (tmp_path / "orc-failures").exists()


def test_link_error_runs_the_failed_parts_callback_as_celery_does(
    orc: Orchestrator, canvas_worker: None, plain_env: dict[str, str], tmp_path: Path
) -> None:
    out = plain(plain_env, tmp_path / "plain-failures", fail=True)
    assert out["error"].startswith("ValueError: no rows for"), out
    celery_lines = lines(tmp_path / "plain-failures")

    run = orc.submit(workflow(DAY, failures=str(tmp_path / "orc-failures"), fail=True, queue=QUEUE))
    status = finished(orc, run.id)
    assert status.state is RunState.FAILED
    orc_lines = lines(tmp_path / "orc-failures")
    # the same callback, called once, with the failed task's request and exception (ids differ)
    strip = [{k: v for k, v in line.items() if k != "id"} for line in (celery_lines, orc_lines) for line in line]
    assert strip[: len(celery_lines)] == strip[len(celery_lines) :], (celery_lines, orc_lines)
    assert len(orc_lines) == 1 and orc_lines[0]["id"].startswith(f"{run.id}.extract.")
    tasks = {t.key: t.state.value for t in orc.tasks(run.id)}
    assert tasks["extract"] == "FAILED" and tasks["notify_failure-extract"] == "SUCCEEDED"
    # a later part's callback does not run: its part did not fail itself (it was never run)
    assert tasks["notify_failure-load"] in ("SKIPPED", "UPSTREAM_FAILED")


def test_converted_keys_work_with_explain_and_clear(orc: Orchestrator, canvas_worker: None, tmp_path: Path) -> None:
    run = orc.submit(workflow(DAY, failures=str(tmp_path / "f"), queue=QUEUE))
    assert finished(orc, run.id).state is RunState.SUCCEEDED
    before = results(orc, run.id)
    assert orc.explain(run.id, "transform[2]")
    orc.clear(run.id, "transform[2]", downstream=True)
    status = finished(orc, run.id)
    assert status.state is RunState.SUCCEEDED
    after = {t.key: (t.result, t.attempt) for t in orc.tasks(run.id)}
    assert after["transform[2]"][1] == 2 and after["aggregate"][1] == 2 and after["extract"][1] == 1
    assert {k: v[0] for k, v in after.items()} == before


def test_a_builder_node_takes_its_parents_result_positionally(orc: Orchestrator, canvas_worker: None) -> None:
    dag = DAG("positional")
    first = dag.task("extract", extract.s(DAY, rows=4))
    dag.task("part", transform.s(part=1, parts=2), upstream=[first], parent_arg=True)
    dag.task("after", stamp.si("x"), upstream=["part"])
    run = orc.submit(dag)
    assert finished(orc, run.id).state is RunState.SUCCEEDED
    assert results(orc, run.id)["part"] == {"part": 1, "count": 2, "amount": 11 + 13}
    with pytest.raises(ValidationError, match="exactly one upstream"):
        DAG("two").task("x", transform.s(part=0), upstream=["a", "b"], parent_arg=True)


def test_a_canvas_run_of_a_tenant_cancelled_mid_chord_stops_and_calls_no_error_callback(
    orc: Orchestrator, canvas_worker: None, tmp_path: Path
) -> None:
    failures = tmp_path / "failures"
    dag = DAG.from_canvas(workflow(DAY, failures=str(failures), queue=QUEUE, pause=30), name="canvas", tenant="acme")
    run = orc.submit(dag)
    assert run.status().tenant == "acme"
    until("a header part running", lambda: run.task("transform[0]").state.value == "RUNNING")
    run.cancel(by="test")
    status = run.wait(timeout=120)
    assert status.state is RunState.CANCELLED
    states = {t.key: t.state.value for t in run.tasks()}
    assert states["extract"] == "SUCCEEDED" and states["transform[0]"] == "CANCELLED", states
    assert not failures.exists()  # a cancel is not a failure: no error callback ran
