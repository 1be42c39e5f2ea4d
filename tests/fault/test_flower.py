"""Flower, for real: the compose file's Flower command against a real prefork worker.

A Flower process is started with the command and the ``FLOWER_BASIC_AUTH`` of
``docker-compose.yml`` (on a free 127.0.0.1 port), beside a worker whose task events are off, as
in production: Flower turns them on with its ``enable_events`` broadcast. Events published before
Flower's receiver listens are lost for good (a fanout, not a queue), so the DAG is submitted only
once Flower has heard the worker's heartbeat *and* the worker logged that task events were
enabled. Then every attempt that ran must be in Flower's HTTP API under its real task name and
its ``<run>.<key>.<attempt>`` id, in the state the database's ledger gave it; a task that never
ran (UPSTREAM_FAILED) must not be there. Flower shows attempts, not runs: a DEAD_LETTER attempt
is a plain FAILURE there while the run waits for an operator.
"""

from __future__ import annotations

import base64
import json
import secrets
import sys
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from orchestrator import DAG, RunState, TaskState
from orchestrator.core.protocol import parse_task_id, task_id
from tests.fault.harness import Cluster, P, Proc, accepted, free_port
from tests.test_compose import COMPOSE, argv, interpolate

pytestmark = pytest.mark.fault
T = TaskState
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}
FINAL = {"SUCCESS", "FAILURE", "REVOKED", "REJECTED", "IGNORED"}
ENABLED = "Events of group {task} enabled by remote."


class Flower:
    """Flower's HTTP API on 127.0.0.1 with basic auth."""

    def __init__(self, proc: Proc, port: int, user: str, password: str) -> None:
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def get(self, path: str, *, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or text) with our credentials (or ``headers``); status 0 while
        nothing listens yet."""
        sent = {"Authorization": self.auth} if headers is None else headers
        request = urllib.request.Request(self.base + path, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read().decode()
                status = int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None
        return status, json.loads(body) if body.startswith(("{", "[")) else body

    def tasks(self) -> dict[str, Any]:
        status, body = self.get("/api/tasks")
        assert status == 200, (status, body)
        assert isinstance(body, dict)
        return body


def start_flower(cluster: Cluster, user: str, password: str) -> Flower:
    """The compose service's command and FLOWER_* environment, on a free loopback port."""
    service = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]["flower"]
    args = argv(service)
    assert args[:4] == ["celery", "-A", "config.celery_app", "flower"], args
    port = free_port()
    cmd = [sys.executable, "-m", *(a for a in args if not a.startswith("--port")), f"--port={port}"]
    cmd.append("--address=127.0.0.1")
    compose_env = {"FLOWER_USER": user, "FLOWER_PASSWORD": password}
    flower_env = {
        k: interpolate(str(v), compose_env) for k, v in service["environment"].items() if k.startswith("FLOWER_")
    }
    assert set(flower_env) == {"FLOWER_BASIC_AUTH"}, flower_env
    proc = cluster._spawn("flower", cmd, cluster.env(**flower_env))
    return Flower(proc, port, user, password)


def test_flower_shows_every_attempt_as_the_database_recorded_it(cluster: Cluster) -> None:
    # Given a worker with task events off (the default), and Flower started as compose starts it
    assert not cluster.settings.task_events
    worker = cluster.worker("w1", concurrency=2)
    user, password = "ops", "pw-" + secrets.token_hex(8)
    flower = start_flower(cluster, user, password)
    try:

        def flower_hears_the_worker() -> bool:
            assert flower.proc.popen.poll() is None, flower.proc.tail()
            status, body = flower.get("/api/workers?status=true")
            return status == 200 and isinstance(body, dict) and body.get("w1@fault") is True

        # Then Flower answers only with its credentials
        cluster.wait_for(flower_hears_the_worker, 60, "Flower receiving the worker's heartbeats")
        wrong = "Basic " + base64.b64encode(f"{user}:nope".encode()).decode()
        for headers in ({}, {"Authorization": wrong}):
            status, _ = flower.get("/api/tasks", headers=headers)
            assert status == 401, (headers, status)
        # and its enable_events broadcast reached the worker: task events flow from here on
        cluster.wait_for(lambda: ENABLED in worker.text(), 30, "Flower enabling the worker's task events")

        # When a DAG runs: a success, a retry, a failure, a poison task parked in DEAD_LETTER,
        # a child that never runs (UPSTREAM_FAILED) and an all_done clean-up
        dag = DAG("flower")
        start = dag.task("start", P + "noop")
        wobbly = dag.task(
            "wobbly", P + "flaky", kwargs={"fail_times": 1}, upstream=[start], max_attempts=2, backoff=FAST_BACKOFF
        )
        broken = dag.task("broken", P + "fail", kwargs={"message": "expected failure"}, upstream=[start])
        poison = dag.task(
            "poison",
            P + "fail",
            kwargs={"message": "bad row 7"},
            upstream=[start],
            max_attempts=3,
            backoff=FAST_BACKOFF,
        )
        dag.task("report", P + "echo", upstream=[wobbly, broken])
        dag.task("cleanup", P + "echo", upstream=[wobbly, broken, poison], trigger_rule="all_done")
        run = cluster.orc.submit(dag)
        ids = {key: {a: task_id(run.id, key, a) for a in (1, 2)} for key in dag.nodes}

        # Then while the poison task waits in DEAD_LETTER (the run RUNNING, needing attention),
        # Flower shows its two attempts as plain Celery failures
        cluster.wait_task(run.id, "poison", lambda t: t.state is T.DEAD_LETTER, 60, "poison dead-lettered")
        view = cluster.store.reads.get_run(run.id)
        assert view.state is RunState.RUNNING and view.needs_attention

        def flower_states(wanted: set[str]) -> dict[str, Any] | None:
            found = flower.tasks()
            return found if all(found.get(i, {}).get("state") in FINAL for i in wanted) else None

        parked = {ids["poison"][1], ids["poison"][2]}
        seen = cluster.wait_for(lambda: flower_states(parked), 30, "Flower seeing the poison attempts", run_id=run.id)
        assert {seen[i]["state"] for i in parked} == {"FAILURE"}

        # When an operator gives up on it, the clean-up runs and the run ends FAILED
        run.fail("poison", by="flower-test")
        assert cluster.wait_run(run.id, 60) is RunState.FAILED
        rows = {t.key: t for t in cluster.store.reads.get_tasks(run.id)}
        assert {k: (t.state, t.attempt) for k, t in rows.items()} == {
            "start": (T.SUCCEEDED, 1),
            "wobbly": (T.SUCCEEDED, 2),
            "broken": (T.FAILED, 1),
            "poison": (T.FAILED, 2),
            "report": (T.UPSTREAM_FAILED, 1),
            "cleanup": (T.SUCCEEDED, 1),
        }

        # What every attempt became, from the ledger: its claim, then its outcome
        events = cluster.events(run.id)
        claims = {(e.key, e.attempt) for e in accepted(events, src="QUEUED", dst="RUNNING", actor="worker")}
        outcomes = {(e.key, e.attempt): e.to_state for e in accepted(events, src="RUNNING") if e.to_state != "RUNNING"}
        assert set(outcomes) == claims
        expected = {
            task_id(run.id, key, attempt): ("SUCCESS" if outcomes[(key, attempt)] == "SUCCEEDED" else "FAILURE")
            for key, attempt in claims
        }
        assert set(expected) == {
            ids["start"][1], ids["wobbly"][1], ids["wobbly"][2], ids["broken"][1], ids["poison"][1],
            ids["poison"][2], ids["cleanup"][1],
        }  # fmt: skip

        # Then Flower has exactly these attempts, each under its real task name and id, in the
        # state the database recorded, run by the worker the database names
        shown = cluster.wait_for(lambda: flower_states(set(expected)), 30, "Flower seeing every attempt", run_id=run.id)
        assert set(shown) == set(expected), sorted(set(shown) ^ set(expected))
        for tid, info in shown.items():
            parsed = parse_task_id(tid)
            assert parsed is not None and parsed[0] == run.id, tid
            _, key, attempt = parsed
            row = rows[key]
            assert info["name"] == row.task, (tid, info["name"])
            assert info["state"] == expected[tid], (tid, info["state"], outcomes[(key, attempt)])
            assert info["worker"] == "w1@fault", (tid, info["worker"])
            if info["state"] == "FAILURE":
                assert "Flaky" in info["exception"] or "ProbeFailure" in info["exception"], info["exception"]
        # the final attempt of every task that ran is in the state its row ended in
        celery_state = {T.SUCCEEDED: "SUCCESS", T.FAILED: "FAILURE"}
        for key, row in rows.items():
            if row.state in celery_state:
                assert shown[task_id(run.id, key, row.attempt)]["state"] == celery_state[row.state], key
                assert row.worker is not None and row.worker.startswith("w1@fault:"), row.worker
        assert not [tid for tid in shown if parse_task_id(tid) == (run.id, "report", 1)]  # it never ran

        # and one attempt in detail: the dead-lettered one, by id
        status, info = flower.get(f"/api/task/info/{ids['poison'][2]}")
        assert status == 200, (status, info)
        assert info["uuid"] == ids["poison"][2] and info["name"] == P + "fail" and info["state"] == "FAILURE"
        assert info["worker"] == "w1@fault" and info["received"] and info["started"] and info["failed"]
        assert "bad row 7" in info["exception"]
    finally:
        flower.proc.stop()
    cluster.assert_clean([run.id])
