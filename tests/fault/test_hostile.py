"""Hostile messages against a real worker: whatever arrives on a queue, the worker acks or
rejects it with a log line and keeps consuming; forged messages never touch a run.

Each case is published straight through kombu (not ``send_task``), with the body, headers and
content type an attacker or a broken producer could send. After all of them a normal DAG must
still succeed on the same worker, the worker must never have exited, and the ledger must hold
nothing for the forged messages."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer

from orchestrator import DAG, RunState, TaskState
from orchestrator.core.protocol import (
    HEADER_ATTEMPT,
    HEADER_DIRECT,
    HEADER_KEY,
    HEADER_RUN,
    HEADER_SIGNATURE,
    FencingToken,
    sign,
)
from orchestrator.store import schema as s
from tests.fault.harness import Cluster, P, rejected

pytestmark = pytest.mark.fault

QUEUE = "orchestrator.default"
NOOP = P + "noop"


def _headers(task: Any = NOOP, **extra: Any) -> dict[str, Any]:
    tid = str(uuid.uuid4())
    h: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": tid,
        "root_id": tid,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "timelimit": [None, None],
        "eta": None,
        "expires": None,
        "argsrepr": "()",
        "kwargsrepr": "{}",
        "origin": "hostile@test",
        "ignore_result": True,
    }
    h.update(extra)
    return h


GOOD_BODY = [[], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]


def _cases(run_id: str) -> Iterator[tuple[str, Any, dict[str, Any], str]]:
    """(name, body, headers, content type) of every hand-written hostile message."""
    j = "application/json"
    yield "string body", "a string body", _headers(), j
    yield "two-element body", [[], {}], _headers(), j
    yield "one-element body", [[]], _headers(), j
    yield "dict body", {"args": []}, _headers(), j
    yield "null body", None, _headers(), j
    yield "args not a list", ["abc", {}, {}], _headers(), j
    yield "kwargs not a dict", [[], [], {}], _headers(), j
    yield "embed not a dict", [[], {}, "x"], _headers(), j
    yield "callbacks not a list", [[], {}, {"callbacks": "x"}], _headers(), j
    yield "timelimit strings", GOOD_BODY, _headers(timelimit=["a", "b"]), j
    yield "timelimit scalar", GOOD_BODY, _headers(timelimit=5), j
    yield "timelimit tiny", GOOD_BODY, _headers(timelimit=[1e-299, 1e-299]), j
    yield "timelimit negative", GOOD_BODY, _headers(timelimit=[-1, -1]), j
    yield "eta garbage", GOOD_BODY, _headers(eta="not a date"), j
    yield "expires garbage", GOOD_BODY, _headers(expires={"x": 1}), j
    yield "retries string", GOOD_BODY, _headers(retries="x"), j
    yield "no id", GOOD_BODY, {k: v for k, v in _headers().items() if k != "id"}, j
    yield "id not a string", GOOD_BODY, _headers(id=["x"]), j
    yield "task not a string", GOOD_BODY, _headers(task=["x"]), j
    yield "task null", GOOD_BODY, _headers(task=None), j
    yield "unknown task", GOOD_BODY, _headers(task="no.such.task"), j
    yield "pickle content", GOOD_BODY, _headers(), "application/x-python-serialize"
    yield "unknown content type", GOOD_BODY, _headers(), "application/x-nonsense"
    yield "deep args", ("[[" + "[" * 960 + "0" + "]" * 960 + "], {}, {}]").encode(), _headers(), j
    yield "not JSON", b"\xff\xfe{not json", _headers(), j
    yield "big args", [["x" * 2_000_000], {}, {}], _headers(), j
    yield "orc headers, no such run", GOOD_BODY, _headers(**_token(uuid.uuid4().hex, "a", 1)), j
    yield "orc headers, bad attempt", GOOD_BODY, _headers(**_token(run_id, "a", "1")), j
    yield "orc headers, attempt bool", GOOD_BODY, _headers(**_token(run_id, "a", True)), j
    yield "orc headers, key list", GOOD_BODY, _headers(**_token(run_id, ["a"], 1)), j
    yield "orc task id, no headers, time limit", GOOD_BODY, _headers(id=f"{run_id}.a.1", timelimit=[0.5, 0.5]), j


def _token(run_id: Any, key: Any, attempt: Any, signature: Any = "0" * 64) -> dict[str, Any]:
    return {HEADER_RUN: run_id, HEADER_KEY: key, HEADER_ATTEMPT: attempt, HEADER_SIGNATURE: signature}


def _fuzzed(rng: random.Random, run_id: str, n: int) -> Iterator[tuple[str, Any, dict[str, Any], str]]:
    """Generated cases: random body shapes, header values and content types."""
    values: list[Any] = [None, True, 0, -1, 1e308, "x", "", [], {}, ["a", "b"], {"a": 1}, [[]], "\u0000", 2**70]
    keys = ["task", "id", "timelimit", "eta", "expires", "retries", "root_id", "parent_id", "group", "argsrepr"]
    keys += ["kwargsrepr", "origin", "ignore_result", "shadow", "stamps", "replaced_task_nesting"]
    keys += [HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT]
    bodies: list[Any] = [GOOD_BODY, [[], {}], "s", 1, None, {}, [1, 2, 3], [[], {}, {}, {}], [None, None, None]]
    types = ["application/json", "application/json", "application/json", "text/plain", "application/x-yaml"]
    for i in range(n):
        headers = _headers()
        for key in rng.sample(keys, rng.randint(1, 4)):
            headers[key] = rng.choice(values + ([run_id] if key == HEADER_RUN else []))
        yield f"fuzz {i}", rng.choice(bodies), headers, rng.choice(types)


def _publish(cluster: Cluster, cases: list[tuple[str, Any, dict[str, Any], str]]) -> None:
    exchange = Exchange(QUEUE, type="direct")
    with Connection(cluster.settings.broker_url) as conn:
        producer = Producer(conn.default_channel, exchange=exchange, routing_key=QUEUE)
        for _, body, headers, content_type in cases:
            if isinstance(body, bytes):
                raw = body
            elif content_type == "application/x-python-serialize":
                raw = b"\x80\x04N."  # pickle of None
            else:
                raw = json.dumps(body).encode()
            producer.publish(raw, headers=headers, content_type=content_type, content_encoding="utf-8")


def test_a_worker_survives_hostile_messages_and_forged_ones_touch_nothing(cluster: Cluster) -> None:
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0")
    worker = cluster.worker("w1", concurrency=2)
    # a run whose task "a" is QUEUED with attempt 1 while forged messages arrive
    victim = DAG("victim")
    victim.task("a", NOOP)
    run = cluster.orc.submit(victim)
    cases = list(_cases(run.id)) + list(_fuzzed(random.Random(7), run.id, 1000))
    _publish(cluster, cases)
    cluster.wait_drained(timeout=120)
    assert worker.popen.poll() is None, worker.tail()
    # a normal DAG still runs on the same worker
    dag = DAG("after")
    a = dag.task("a", P + "echo", kwargs={"n": 1})
    dag.task("b", P + "echo", upstream=[a])
    after = cluster.orc.submit(dag)
    assert cluster.wait_run(after.id, 60) is RunState.SUCCEEDED, worker.tail()
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED, worker.tail()
    assert worker.popen.poll() is None, worker.tail()
    # the forged messages that named the victim's run wrote nothing to its ledger
    assert rejected(cluster.events(run.id)) == [], cluster.events(run.id)
    with cluster.store.engine.connect() as conn:
        runs = set(conn.execute(sa.select(s.events.c.run_id).distinct()).scalars())
    assert runs == {run.id, after.id}, "no event for a run that does not exist"
    assert worker.text().count("dropping message") >= len(cases) - 40, worker.tail()


def test_forged_fencing_headers_never_touch_a_run(cluster: Cluster) -> None:
    """A running attempt is attacked with messages that carry its fencing headers under
    another task's name, a wrong signature, or its task id with no headers and a time limit
    that kills the body: the attempt's outcome is the real one and nothing else is written."""
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0")
    worker = cluster.worker("w1", concurrency=3)
    victim = DAG("victim")
    victim.task("a", P + "sleep", kwargs={"seconds": 3.0})
    run = cluster.orc.submit(victim)
    cluster.wait_task(run.id, "a", lambda t: t.state is TaskState.RUNNING, 20, "the victim running")
    token = FencingToken(run.id, "a", 1)
    key = cluster.store.signing_key
    j = "application/json"
    forged = [
        # the real signature, replayed on another task's message
        (
            "echo with a's headers",
            GOOD_BODY,
            _headers(P + "echo", **_token(run.id, "a", 1, sign(key, P + "sleep", token))),
            j,
        ),
        # the right task, a signature made with another key
        (
            "wrong key",
            GOOD_BODY,
            _headers(P + "sleep", **_token(run.id, "a", 1, sign(b"k" * 32, P + "sleep", token))),
            j,
        ),
        # the attempt's headers made direct (its body would start before the claim) with the
        # signature of the plain token: a direct message's signature covers its arguments
        (
            "made direct",
            [[], {"seconds": 30.0}, GOOD_BODY[2]],
            _headers(P + "sleep", **_token(run.id, "a", 1, sign(key, P + "sleep", token)), **{HEADER_DIRECT: True}),
            j,
        ),
        # a direct message's real signature with other arguments
        (
            "direct, other arguments",
            [[], {"seconds": 30.0}, GOOD_BODY[2]],
            _headers(
                P + "sleep",
                **_token(run.id, "a", 1, sign(key, P + "sleep", token, ([], {"seconds": 3.0}))),
                **{HEADER_DIRECT: True},
            ),
            j,
        ),
        # no fencing headers at all, the attempt's task id and a hard limit that kills the body
        ("task id only", [[5.0], {}, {}], _headers(P + "sleep", id=token.task_id, timelimit=[0.3, 0.5]), j),
    ]
    _publish(cluster, forged)
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED, worker.tail()
    events = cluster.events(run.id)
    assert rejected(events) == [], events
    assert [(e.from_state, e.to_state, e.actor) for e in events if e.key == "a"] == [
        ("PENDING", "READY", "submit"),
        ("READY", "QUEUED", "dispatcher"),
        ("QUEUED", "RUNNING", "worker"),
        ("RUNNING", "SUCCEEDED", "worker"),
    ], events
    assert worker.text().count("signature does not verify") == 4, worker.tail()
    assert "Hard time limit" in worker.text(), worker.tail()
    assert worker.popen.poll() is None


def test_a_message_that_keeps_killing_its_pool_process_is_parked(cluster: Cluster) -> None:
    """A plain Celery message (no fencing headers) whose body kills its pool process comes back
    flagged redelivered each time; past the limit it is parked with the evidence, and the
    worker goes on with other work."""
    cluster.configure(ORCHESTRATOR_WORKER_RECONCILER="0", ORCHESTRATOR_MAX_REDELIVERIES="2")
    worker = cluster.worker("w1", concurrency=2)
    sent = cluster.orc.app.send_task(P + "crash", queue=QUEUE)
    parked = cluster.wait_for(lambda: cluster.store.deliveries.parked(), 60, "the crashing message parked")
    assert [(p["message_id"], p["deliveries"]) for p in parked] == [(sent.id, 3)]
    assert "over ORCHESTRATOR_MAX_REDELIVERIES=2" in parked[0]["evidence"]["reason"]
    assert cluster.redis.llen("orchestrator.parked") == 1
    assert cluster.redis.llen(QUEUE) == 0
    assert worker.text().count("WorkerLostError: Worker exited prematurely: signal 9") >= 2, worker.tail()
    # the worker still runs DAGs
    dag = DAG("after")
    dag.task("a", P + "echo", kwargs={"n": 1})
    assert cluster.wait_run(cluster.orc.submit(dag).id, 60) is RunState.SUCCEEDED, worker.tail()
