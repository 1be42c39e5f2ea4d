"""No secret is printed or logged: a database password and a webhook URL planted in the
settings never appear in the output of the commands, nor in a worker's or a reconciler's log,
even when the webhook fails (an alert for a dead-lettered task is sent to an address that
refuses it) and when the database is unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import DAG, TaskState
from orchestrator.core import redact
from tests.fault.harness import Cluster, P

pytestmark = pytest.mark.fault

SECRET = "planted-s3cret"


def test_planted_secrets_never_show(cluster: Cluster, tmp_path: Path) -> None:
    planted_db = cluster.database_url.replace("postgres@", f"postgres:{SECRET}@", 1)  # trust auth ignores it
    assert SECRET in planted_db
    cluster.configure(
        ORCHESTRATOR_DATABASE_URL=planted_db,
        ORCHESTRATOR_ALERT_WEBHOOK=f"http://127.0.0.1:1/hooks/{SECRET}?token={SECRET}",
        ORCHESTRATOR_POISON_THRESHOLD="2",
    )
    worker = cluster.worker("w1", concurrency=2)
    dag = DAG("secrets")
    dag.task("bad", P + "fail", max_attempts=3, backoff={"base": 0.05, "cap": 0.05, "jitter": "none"})
    run = cluster.orc.submit(dag)
    cluster.wait_task(run.id, "bad", lambda t: t.state is TaskState.DEAD_LETTER, 60, "the poisoned task parked")
    cluster.wait_for(lambda: "alert webhook" in worker.text(), 30, "the failing webhook logged")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "s", "nodes": [{"key": "a", "task": P + "noop"}]}))
    outputs = [
        cluster.cli(*args)
        for args in (
            ("runs",),
            ("status", run.id),
            ("events", run.id),
            ("verify", run.id),
            ("db", "check"),
            ("submit", str(spec)),
            ("reconcile", "--once"),
        )
    ]
    unusable = cluster.cli("runs", ORCHESTRATOR_DATABASE_URL=f"postgresql://postgres:{SECRET}@127.0.0.1:1/x")
    assert unusable.returncode == 2 and unusable.stderr.strip().splitlines()[-1].startswith("error: database:")
    for done in [*outputs, unusable]:
        assert SECRET not in done.stdout + done.stderr, (done.args, done.stdout, done.stderr)
    assert all(done.returncode in (0, 1) for done in outputs), [(d.args, d.stderr) for d in outputs]
    assert "alert webhook http://127.0.0.1/… failed" in worker.text(), worker.tail()
    assert SECRET not in worker.text(), [line for line in worker.text().splitlines() if SECRET in line][:5]


def test_redact() -> None:
    assert redact.url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact.url("postgresql+psycopg://u:pw@h/db?sslmode=require&password=x") == (
        "postgresql+psycopg://u:***@h/db?sslmode=require&password=***"
    )
    assert redact.url("amqp://guest@h//") == "amqp://guest@h//"
    assert redact.url("embedded:///tmp/x/pg") == "embedded:///tmp/x/pg"
    assert redact.url("filesystem://") == "filesystem://"
    assert redact.webhook("https://hooks.slack.com/services/T0/B0/XYZ?token=1") == "https://hooks.slack.com/…"
