"""The tenant wall: a caller bound to tenant ``b`` tries every read and every action on tenant
``a``'s run (and schedule) through the Python API, the command line, the web pages and the JSON
API. Each one is refused as not found (``RunNotFound`` / exit 2 ``no run with id`` / 404), and
nothing is written: the ledger, the runs, the tasks and the schedules are the same after.

The refusals come from the store's roles scoped to the tenant (``Reads.scoped``,
``OperatorActions.scoped``, ``ScheduleRows.scoped``), so the callers here do nothing to earn
them. Postgres only (the ``pg_url`` fixture).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunNotFound, Settings, TaskNotFound, TaskState
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.engine.facade import RunHandle
from orchestrator.services.schedule_model import ScheduleNotFound
from orchestrator.store import schema as s
from orchestrator.web.metrics import render as render_metrics
from tests.conftest import empty_tables

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["t.ok", "t.fail"]
TOKEN = "wall-token-0123456789abcdef"


def make(pg_url: str, data_dir: Path, tenant: str = "") -> Orchestrator:
    settings = Settings.from_env({}, data_dir=str(data_dir), database_url=pg_url, tenant=tenant)
    return Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[tuple[Orchestrator, Orchestrator, str]]:
    """Tenant a's run: ``a`` parked in DEAD_LETTER (so that retry, skip, fail and cancel would
    all apply), ``b`` waiting on it; a schedule of tenant a. Returns (a's orchestrator, b's, run id)."""
    admin = make(pg_url, tmp_path)
    empty_tables(admin.store.engine)
    admin.register_worker("w", default_queues(), 4)
    a, b = make(pg_url, tmp_path, "a"), make(pg_url, tmp_path, "b")
    dag = DAG("secret", tenant="a")
    first = dag.task("a", "t.fail", max_attempts=3, backoff={"base": 0.001, "cap": 0.001})
    dag.task("b", "t.ok", upstream=[first])
    run = a.submit(dag)
    publisher = a.publisher
    assert isinstance(publisher, RecordingPublisher)
    for _ in range(2):  # the same failure twice: poison, DEAD_LETTER
        (d,) = _dispatched(a, publisher, "a")
        assert a.claim(d.token, "w:1", d.task_name) is not None
        a.fail_attempt(d.token, error="boom", exc_types=["ValueError"], fingerprint="same")
    assert a.task(run.id, "a").state is TaskState.DEAD_LETTER
    spec = tmp_path / "nightly.yaml"
    spec.write_text("name: nightly\ntenant: a\nnodes:\n  - {key: x, task: t.ok}\n")
    a.schedules.add("a-nightly", every=3600, spec=str(spec))
    # b has a run of its own: the wall is about a's, not about b seeing nothing at all
    mine = DAG("mine")
    mine.task("x", "t.ok")
    b.submit(mine)
    yield a, b, run.id
    for o in (admin, a, b):
        o.store.dispose()


def _dispatched(orc: Orchestrator, publisher: RecordingPublisher, key: str) -> list[Any]:
    """The task's next dispatch (its retry is released by a reconciler pass once due)."""
    import time

    for _ in range(100):
        found = [d for d in publisher.take() if d.key == key]
        if found:
            return found
        time.sleep(0.02)
        orc.reconcile()
    raise AssertionError(f"{key} was never dispatched")


def written(orc: Orchestrator) -> dict[str, Any]:
    """Everything a refused call could have written."""
    with orc.store.engine.connect() as conn:
        return {
            "events": conn.execute(sa.select(sa.func.count()).select_from(s.events)).scalar_one(),
            "last_event": conn.execute(sa.select(sa.func.max(s.events.c.id))).scalar(),
            "runs": sorted(map(tuple, conn.execute(sa.select(s.runs.c.id, s.runs.c.state, s.runs.c.tenant)).all())),
            "tasks": sorted(
                map(tuple, conn.execute(sa.select(s.tasks.c.run_id, s.tasks.c.key, s.tasks.c.state, s.tasks.c.attempt)))
            ),
            "schedules": sorted(
                map(tuple, conn.execute(sa.select(s.schedules.c.name, s.schedules.c.tenant, s.schedules.c.paused)))
            ),
            "firings": conn.execute(sa.select(sa.func.count()).select_from(s.firings)).scalar_one(),
        }


# ---------------------------------------------------------------------- (a) the Python API


def test_python_api(world: tuple[Orchestrator, Orchestrator, str]) -> None:
    a, b, run_id = world
    before = written(a)
    handle = RunHandle(b, run_id)  # a handle made by hand: the wall is not in orc.run()
    refused: dict[str, Callable[[], object]] = {
        "run": lambda: b.run(run_id),
        "visible": lambda: b.visible(run_id),
        "tasks": lambda: b.tasks(run_id),
        "task": lambda: b.task(run_id, "a"),
        "events": lambda: b.ledger(run_id),
        "events newest": lambda: b.ledger(run_id, newest=5),
        "edges": lambda: b.edges(run_id),
        "run_state": lambda: b.run_state(run_id),
        "explain": lambda: b.explain(run_id),
        "explain key": lambda: b.explain(run_id, "a"),
        "verify": lambda: b.verify([run_id]),
        "cancel": lambda: b.cancel(run_id),
        "retry": lambda: b.retry_task(run_id, "a"),
        "skip": lambda: b.skip_task(run_id, "a"),
        "fail": lambda: b.fail_task(run_id, "a"),
        "handle status": handle.status,
        "handle state": lambda: handle.state,
        "handle tasks": handle.tasks,
        "handle task": lambda: handle.task("a"),
        "handle events": handle.events,
        "handle results": handle.results,
        "handle wait": lambda: handle.wait(1),
        "handle cancel": handle.cancel,
        "handle retry": lambda: handle.retry("a"),
        "handle skip": lambda: handle.skip("a"),
        "handle fail": lambda: handle.fail("a"),
        "reads get_run": lambda: b.reads.get_run(run_id),
        "reads explain_input": lambda: b.reads.explain_input(run_id, worker_ttl=30, depth=2),
    }
    for name, call in refused.items():
        with pytest.raises(RunNotFound, match=f"no run with id '{run_id}'"):
            call()
        assert written(a) == before, name
    # a task key that does not exist either: still the run that is not found, not the task
    with pytest.raises(RunNotFound):
        b.retry_task(run_id, "nope")
    assert b.logical_date(run_id) is None
    assert run_id not in {v.id for v in b.runs(100)}
    # bulk actions select b's own runs only: a's RUNNING run is in no report, and nothing is written
    for action in ("cancel", "retry", "rerun"):
        selected = b.bulk.apply(action, state="RUNNING", dry_run=True).items
        assert selected and {i.tenant for i in selected} == {"b"} and run_id not in {i.run_id for i in selected}
        assert b.bulk.apply(action, dag="secret", tenant="a").items == []
        assert b.bulk.apply(action, dag="secret").items == []
    assert written(a) == before
    assert b.runs(100, tenant="a") == [] and b.runs(100, tenant="a", state="RUNNING") == []
    assert b.reads.list_runs(100, tenant="a") == []
    # metrics: b's own families only, none of a's, and not the deployment's workers
    body = render_metrics(b)[0].decode()
    assert 'tenant="a"' not in body and 'tenant="b"' in body
    assert "orchestrator_worker_slots{" not in body and 'tenant="a"' in render_metrics(a)[0].decode()
    admin = Orchestrator(
        dataclasses.replace(a.settings, tenant=""), store=a.store, publisher=RecordingPublisher(), registry=a.registry
    )
    admin_body = render_metrics(admin)[0].decode()
    assert 'orchestrator_worker_slots{worker="w"}' in admin_body
    # schedules: another tenant's is not found; its name cannot be taken over
    sched = b.schedules
    for name, call in {
        "get": lambda: sched.get("a-nightly"),
        "pause": lambda: sched.pause("a-nightly"),
        "resume": lambda: sched.resume("a-nightly"),
        "trigger": lambda: sched.trigger("a-nightly"),
        "remove": lambda: sched.remove("a-nightly"),
        "firings": lambda: sched.firings("a-nightly"),
        "backfill": lambda: list(sched.backfill("a-nightly", *_day())),
    }.items():
        with pytest.raises(ScheduleNotFound):
            call()
        assert written(a) == before, name
    assert [x.name for x in sched.all()] == [] and b.store.schedule_rows.scoped("b").firings("a-nightly") == []
    # names are per tenant: b may have its own "a-nightly"; a's is untouched and never named
    assert sched.add("a-nightly", every=60, dag="tasks.dags:daily_etl").tenant == "b"
    sched.remove("a-nightly")
    assert written(a) == before
    # the owner and the deployment's operator still see and act
    assert a.run(run_id).status().tenant == "a" and a.schedules.get("a-nightly").tenant == "a"
    a.skip_task(run_id, "a")
    assert a.task(run_id, "a").state is TaskState.SKIPPED
    with pytest.raises(TaskNotFound):
        a.task(run_id, "nope")


def _day() -> tuple[Any, Any]:
    import datetime as dt

    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return start, start + dt.timedelta(days=1)


# ---------------------------------------------------------------------- (b) the command line


def test_command_line(world: tuple[Orchestrator, Orchestrator, str], pg_url: str, tmp_path: Path) -> None:
    a, _, run_id = world
    before = written(a)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env.update(ORCHESTRATOR_DATABASE_URL=pg_url, ORCHESTRATOR_DATA_DIR=str(tmp_path / "cli"))
    run_commands = [
        ["status", run_id],
        ["status", run_id, "--json"],
        ["events", run_id],
        ["events", run_id, "--json"],
        ["explain", run_id],
        ["explain", run_id, "a", "--json"],
        ["graph", run_id],
        ["graph", run_id, "--format", "mermaid"],
        ["watch", run_id, "--timeout", "1"],
        ["verify", run_id],
        ["cancel", run_id],
        ["retry", run_id, "a"],
        ["skip", run_id, "a"],
        ["fail", run_id, "a"],
    ]
    schedule_commands = [
        ["schedule", "show", "a-nightly"],
        ["schedule", "pause", "a-nightly"],
        ["schedule", "resume", "a-nightly"],
        ["schedule", "trigger", "a-nightly"],
        ["schedule", "remove", "a-nightly"],
        ["backfill", "a-nightly", "--start", "2026-01-01", "--end", "2026-01-02"],
    ]
    # bound with the option and with the environment variable, every command at once
    jobs = []
    for i, args in enumerate(run_commands + schedule_commands):
        by_env = i % 2 == 1
        argv = [sys.executable, "-m", "orchestrator.cli", *([] if by_env else ["--tenant", "b"]), *args]
        extra = {"ORCHESTRATOR_TENANT": "b"} if by_env else {}
        jobs.append((args, _start(argv, {**env, **extra})))
    for args, proc in jobs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, proc.returncode, out, err)
        expected = "no schedule named 'a-nightly'" if "a-nightly" in args else f"no run with id '{run_id}'"
        assert f"error: {expected}" in err, (args, err)
        assert run_id not in out, (args, out)
    listed = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "--tenant", "b", "runs", "--tenant", "a", "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0 and '"runs": []' in listed.stdout, listed.stderr
    assert written(a) == before
    # the same command as the owner works: the refusals above are the wall, not a broken command
    mine = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "--tenant", "a", "status", run_id],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert mine.returncode == 0 and run_id in mine.stdout, mine.stderr


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )


# ---------------------------------------------------------------------- (c) the web app and JSON API


def test_web_and_json_api(world: tuple[Orchestrator, Orchestrator, str]) -> None:
    from orchestrator.web.app import make_app

    a, b, run_id = world
    before = written(a)
    app = make_app(b, auth=TOKEN, bind="127.0.0.1", cookie_secret="wall")
    reads = [
        f"/runs/{run_id}",
        f"/api/runs/{run_id}",
        f"/api/runs/{run_id}?events=5",
        f"/api/runs/{run_id}/graph",
        f"/api/runs/{run_id}/graph?format=dot",
        f"/api/runs/{run_id}/graph?format=mermaid",
    ]
    actions = [
        f"/runs/{run_id}/cancel",
        *(f"/runs/{run_id}/tasks/a/{verb}" for verb in ("retry", "skip", "fail")),
        f"/api/runs/{run_id}/cancel",
        *(f"/api/runs/{run_id}/tasks/a/{verb}" for verb in ("retry", "skip", "fail")),
    ]
    found = _drive(app, [("GET", p) for p in reads] + [("POST", p) for p in actions])
    for (method, path), (status, body) in zip(
        [("GET", p) for p in reads] + [("POST", p) for p in actions], found, strict=True
    ):
        assert status == 404, (method, path, status, body[:300])
        assert "no run with id" in body, (method, path, body[:300])
        assert "secret" not in body, (method, path)  # nothing of the run: not even its DAG's name
    assert written(a) == before
    listed = dict(
        zip(
            ["api", "api filtered", "page", "page filtered", "metrics"],
            _drive(
                app,
                [
                    ("GET", "/api/runs"),
                    ("GET", "/api/runs?tenant=a"),
                    ("GET", "/runs"),
                    ("GET", "/runs?tenant=a"),
                    ("GET", "/metrics"),
                ],
            ),
            strict=True,
        )
    )
    for name, (status, body) in listed.items():
        assert status == 200 and run_id not in body and "secret" not in body, name
    assert 'tenant="a"' not in listed["metrics"][1]
    # bulk actions (the JSON API's and the runs list's form) select b's runs only: none of a's
    bulk = [
        f"{where}/{action}?state=RUNNING&dry_run=1"
        for where in ("/api/bulk", "/bulk")
        for action in ("cancel", "retry")
    ] + [f"/api/bulk/cancel?dag=secret&tenant={t}" for t in ("a", "")]
    for path, (status, body) in zip(bulk, _drive(app, [("POST", p) for p in bulk]), strict=True):
        assert status == 200 and run_id not in body, (path, status, body[:300])
        assert '"matched": 0' in body if "secret" in path else "secret" not in body, (path, body[:300])
    assert written(a) == before
    # served as the owner, the same addresses answer
    owner = make_app(a, auth=TOKEN, bind="127.0.0.1", cookie_secret="wall")
    ((status, body),) = _drive(owner, [("GET", f"/api/runs/{run_id}")])
    assert status == 200 and '"secret"' in body


def _drive(app: Any, requests: list[tuple[str, str]]) -> list[tuple[int, str]]:
    """Serve ``app`` on a free loopback port and make the requests in turn (bearer token:
    authenticated, and no XSRF form needed); returns (status, body) of each."""
    from tornado.httpclient import AsyncHTTPClient
    from tornado.httpserver import HTTPServer
    from tornado.testing import bind_unused_port

    async def go() -> list[tuple[int, str]]:
        sock, port = bind_unused_port()
        server = HTTPServer(app)
        server.add_sockets([sock])
        client = AsyncHTTPClient()
        out = []
        try:
            for method, path in requests:
                response = await client.fetch(
                    f"http://127.0.0.1:{port}{path}",
                    method=method,
                    body=b"" if method == "POST" else None,
                    headers={"Host": "127.0.0.1", "Authorization": f"Bearer {TOKEN}"},
                    raise_error=False,
                    follow_redirects=False,
                )
                out.append((response.code, (response.body or b"").decode()))
        finally:
            server.stop()
            client.close()
        return out

    return asyncio.run(go())


def test_explain_of_its_own_run_does_not_name_another_tenants(world: tuple[Orchestrator, Orchestrator, str]) -> None:
    """Why b's task waits may be a pool a's task holds: b learns that another tenant holds it,
    not which run (nor, in the fair share, the other tenants' names)."""
    a, b, _ = world
    admin = Orchestrator(
        dataclasses.replace(a.settings, tenant=""), store=a.store, publisher=RecordingPublisher(), registry=a.registry
    )
    admin.limits.set_pool("warehouse", 1)
    holding = DAG("holding")
    holding.task("h", "t.ok", pool="warehouse")
    theirs = a.submit(holding)
    assert a.task(theirs.id, "h").state is TaskState.QUEUED
    waiting = DAG("waiting")
    waiting.task("w", "t.ok", pool="warehouse")
    mine = b.submit(waiting)
    (why,) = b.explain(mine.id, "w")
    text = str([r.to_json() for r in why.reasons])
    assert "warehouse" in text and "another tenant" in text, text
    assert theirs.id not in text and "'a'" not in text, text
    # the operator sees who holds it
    (full,) = admin.explain(mine.id, "w")
    assert theirs.id in str([r.to_json() for r in full.reasons])
