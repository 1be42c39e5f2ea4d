"""The engine and the reconciler without a broker: an in-memory publisher and registry over
SQLite (the Postgres side of the reconciler's duty is in tests/store/test_reconciler_duty.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import DAG, ConfigurationError, ConflictError, Orchestrator, RunState, Settings, TaskState
from orchestrator.core.models import Dispatch
from orchestrator.core.protocol import FencingToken
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.services.reconciler import ReconcilerService

T = TaskState
NAMES = ["t.ok", "t.fail"]


@pytest.fixture
def orc(tmp_path: Path, pg_clean: str) -> Iterator[Orchestrator]:
    settings = Settings.from_env(
        {},
        data_dir=str(tmp_path),
        database_url=pg_clean,
        lease_seconds=0.2,
        dispatch_timeout=0.2,
        tick_seconds=0.05,
    )
    o = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(NAMES, upstream=["t.ok"]))
    o.register_worker("w", default_queues(), 10)
    yield o
    o.store.dispose()


def sent(orc: Orchestrator) -> list[Dispatch]:
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher)
    return publisher.take()


def run_one(orc: Orchestrator, d: Dispatch, result: object = "ok") -> None:
    claim = orc.claim(d.token, "w:1", d.task_name)
    assert claim is not None
    assert orc.complete(d.token, result).accepted


def test_needs_a_publisher_and_registry_or_an_app() -> None:
    with pytest.raises(ConfigurationError, match="Celery app"):
        Orchestrator(Settings(), publisher=RecordingPublisher())


def test_a_run_flows_through_the_publisher(orc: Orchestrator) -> None:
    dag = DAG("flow")
    a = dag.task("a", "t.ok")
    b = dag.task("b", "t.ok", upstream=[a])
    dag.task("c", "t.ok", upstream=[a, b])
    run = orc.submit(dag)
    roots = sent(orc)
    assert [(d.key, d.attempt, d.task_id) for d in roots] == [("a", 1, f"{run.id}.a.1")]
    run_one(orc, roots[0], 1)
    (b_msg,) = sent(orc)  # the completion admitted and published the child
    run_one(orc, b_msg, 2)
    (c_msg,) = sent(orc)
    claim = orc.claim(c_msg.token, "w:1", c_msg.task_name)
    assert claim is not None and claim.upstream_results == {"a": 1, "b": 2}
    assert orc.complete(c_msg.token, 3).accepted
    assert run.state is RunState.SUCCEEDED
    run_events = [(e.from_state, e.to_state, e.actor) for e in run.events() if e.key is None]
    assert run_events == [(None, "RUNNING", "submit"), ("RUNNING", "SUCCEEDED", "worker")]
    # a duplicate delivery of a finished attempt is refused and does not publish anything
    assert orc.claim(c_msg.token, "w:2", c_msg.task_name) is None
    assert sent(orc) == []


def test_reconciler_releases_due_retries_and_dispatches_them(orc: Orchestrator) -> None:
    dag = DAG("retry")
    dag.task("a", "t.fail", max_attempts=3, backoff={"base": 0.05, "cap": 0.05, "jitter": "none"})
    run = orc.submit(dag)
    (msg,) = sent(orc)
    assert orc.claim(msg.token, "w:1", msg.task_name) is not None
    out = orc.fail_attempt(msg.token, error="boom", fingerprint=None)
    assert out.state is T.RETRYING and sent(orc) == []
    time.sleep(0.1)
    report = orc.reconcile()
    assert report["released"] == 1 and report["dispatched"] == 1
    (again,) = sent(orc)
    assert (again.key, again.attempt) == ("a", 2)
    assert run.task("a").state is T.QUEUED


def test_reconciler_republishes_a_lost_dispatch(orc: Orchestrator) -> None:
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher)
    publisher.fail_next = True  # the broker is down when the run is submitted
    dag = DAG("lost")
    dag.task("a", "t.ok")
    run = orc.submit(dag)
    assert sent(orc) == [] and run.task("a").state is T.QUEUED
    time.sleep(0.3)  # past the dispatch timeout
    # the worker's slots are idle: seen once, then confirmed by a pass half a tick later
    assert orc.reconcile()["republished"] == 0
    time.sleep(orc.settings.tick_seconds)
    report = orc.reconcile()
    assert report["republished"] == 1
    (msg,) = sent(orc)
    assert (msg.key, msg.attempt) == ("a", 1)  # same attempt: the first message may still arrive
    run_one(orc, msg)
    assert run.state is RunState.SUCCEEDED
    ledger = [(e.from_state, e.to_state, e.actor) for e in run.events() if e.key == "a"]
    assert ("QUEUED", "QUEUED", "reconciler") in ledger


def test_reconciler_expires_a_lease_from_its_stored_deadline(orc: Orchestrator) -> None:
    dag = DAG("lease")
    dag.task("a", "t.ok", max_attempts=2, backoff={"base": 0.01, "cap": 0.01, "jitter": "none"})
    run = orc.submit(dag)
    (msg,) = sent(orc)
    assert orc.claim(msg.token, "w:1", msg.task_name) is not None
    assert orc.reconcile()["leases_expired"] == 0  # lease_seconds=0.2 still runs
    assert orc.heartbeat(msg.token)
    time.sleep(0.3)
    assert orc.reconcile()["leases_expired"] == 1
    assert not orc.heartbeat(msg.token)  # the body would now fence itself
    assert not orc.complete(msg.token, "late").accepted  # its late result is rejected
    task = run.task("a")
    assert task.state in (T.RETRYING, T.READY, T.QUEUED) and task.attempt == 2


def test_operator_conflicts_are_errors_with_who_acted(orc: Orchestrator) -> None:
    dag = DAG("ops")
    dag.task("a", "t.ok")
    run = orc.submit(dag)
    run_one(orc, sent(orc)[0])
    with pytest.raises(ConflictError, match="only DEAD_LETTER or FAILED"):
        run.retry("a", by="alice")
    with pytest.raises(ConflictError, match="already SUCCEEDED"):
        run.cancel(by="bob")
    refused = [(e.key, e.actor, e.by, e.accepted) for e in run.events() if not e.accepted]
    assert refused == [("a", "operator", "alice", False), (None, "operator", "bob", False)]


def test_cancel_revokes_through_the_publisher(orc: Orchestrator) -> None:
    dag = DAG("cancel")
    dag.task("a", "t.ok")
    dag.task("b", "t.ok", upstream=["a"])
    run = orc.submit(dag)
    (msg,) = sent(orc)
    assert orc.claim(msg.token, "w:1", msg.task_name) is not None
    assert run.cancel(by="carol") == 1
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher) and publisher.revoked == [msg.task_id]
    assert run.state is RunState.CANCELLED
    last = [e for e in run.events() if e.key is None][-1]  # the run first, then its tasks
    assert (last.key, last.to_state, last.by) == (None, "CANCELLED", "carol")


def test_one_reconciler_service_is_on_duty_at_a_time(orc: Orchestrator) -> None:
    service = ReconcilerService(orc.reconciler, name="a", interval=0.05, stall_seconds=5)
    other = ReconcilerService(orc.reconciler, name="b", interval=0.05, stall_seconds=5)
    try:
        assert service.step() is not None
        assert other.step() is None  # the duty lock is held by "a"
        service.release()
        assert other.step() is not None
    finally:
        service.release()
        other.release()


def test_fencing_token_round_trip() -> None:
    token = FencingToken("r", "k", 3)
    assert token.task_id == "r.k.3" and token.headers() == {"orc_run": "r", "orc_key": "k", "orc_attempt": 3}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://postgres@127.0.0.1:1/x", "Connection refused"),
        ("postgresql://postgres:planted-s3cret@127.0.0.1:5432/orchestrator_no_such_db", "does not exist"),
        ("postgresql://postgres@127.0.0.1:5432/postgres?sslmode=bogus", "invalid sslmode"),
        ("nonsense://x", "database URL"),
    ],
)
def test_the_cli_reports_an_unusable_database_in_one_line(url: str, says: str) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["ORCHESTRATOR_DATABASE_URL"] = url
    env["ORCHESTRATOR_LEASE_SECONDS"] = "1"  # reads ride out an outage this long, then give up
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "runs"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    *retries, last = done.stderr.strip().splitlines()
    assert last.startswith("error: ") and says in last, done.stderr
    assert all(line.startswith("database unreachable or busy") for line in retries), done.stderr
    assert "planted-s3cret" not in done.stderr + done.stdout and done.stdout == ""


def test_verify_checks_the_promise_from_the_database(orc: Orchestrator, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import sqlalchemy as sa

    from orchestrator.store import schema as s

    dag = DAG("verified")
    a = dag.task("a", "t.ok")
    dag.task("b", "t.ok", upstream=[a])
    run = orc.submit(dag)
    while pending := sent(orc):
        for d in pending:
            run_one(orc, d)
    assert run.state is RunState.SUCCEEDED
    open_run = orc.submit(dag)  # still running: its open tasks are no violation
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["ORCHESTRATOR_DATABASE_URL"] = orc.settings.database_url

    def verify(*ids: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "verify", *ids], env=env, capture_output=True, text=True
        )

    done = verify()
    assert done.returncode == 0 and "2 run(s) checked: no violation" in done.stdout, done.stderr
    # a second accepted result for b: committed twice
    with orc.store.engine.begin() as conn:
        conn.execute(
            s.events.insert().values(
                run_id=run.id, key="b", attempt=1, from_state="RUNNING", to_state="SUCCEEDED", actor="worker",
                reason=None, accepted=True, at=sa.func.current_timestamp(),
            )
        )  # fmt: skip
    done = verify(run.id, open_run.id)
    assert done.returncode == 1, done.stdout
    assert f"violation: {run.id}.b: 2 accepted results (committed twice)" in done.stdout
    assert "violation(s) in 2 run(s)" in done.stderr


def test_a_direct_messages_signature_covers_its_arguments() -> None:
    from orchestrator.core.protocol import sign, verify

    key, token = b"k" * 32, FencingToken("r", "k", 3)
    plain = sign(key, "t", token)
    direct = sign(key, "t", token, (["a", 1.5], {"n": {"b": 2, "a": [1]}}))
    assert plain != direct
    # the worker's arguments come from the message's JSON: the same values verify, key order aside
    assert verify(key, "t", token, direct, (["a", 1.5], {"n": {"a": [1], "b": 2}}))
    assert not verify(key, "t", token, direct, (["a", 1.5], {"n": {"a": [1], "b": 3}}))
    assert not verify(key, "t", token, plain, (["a", 1.5], {"n": {"a": [1], "b": 2}}))
    assert not verify(key, "t", token, direct, (["a", float("nan")], {}))
    assert verify(key, "t", token, plain)


def test_a_redelivered_message_whose_count_cannot_be_written_goes_back_to_its_queue(tmp_path: Path) -> None:
    """The count of a redelivery is the record of the delivery before it (a direct message's
    body may have run there before its claim): a message is never run without it."""
    from types import SimpleNamespace

    from orchestrator.runtime.celery_app import create_app
    from orchestrator.runtime.inbox import GuardedConsumer

    settings = Settings(
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/unreachable",
        broker_url="memory://",
        lease_seconds=0.2,
        data_dir=str(tmp_path),
    )
    app = create_app(settings)

    class Message:
        headers = {"id": "r.k.1", "task": "tasks.probes.noop"}
        delivery_info = {"redelivered": True}
        requeued: bool | None = None

        def reject_log_error(self, logger: object, errors: object, requeue: bool = False) -> None:
            self.requeued = requeue

    message = Message()
    consumer = SimpleNamespace(app=app, connection_errors=())
    assert GuardedConsumer._too_many_deliveries(consumer, message) is True  # type: ignore[arg-type]
    assert message.requeued is True
