"""Self-fencing: a body whose lease was taken over is stopped, even inside a blocking call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.protocol import FencingToken
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues, route
from orchestrator.runtime.worker import Heartbeater, LeaseLost
from orchestrator.store import Store


@pytest.fixture
def taken_over(pg_clean: str) -> tuple[Heartbeater, Store, str]:
    """A RUNNING attempt whose heartbeat will find it taken over."""
    store = Store(pg_clean)
    store.workers.register("w", default_queues(), 10)
    dag = DAG("fence")
    dag.task("a", "t", max_attempts=3)
    run_id, _ = store.submission.create_run(
        dag, queues={"a": route("default", dag.priority)}, wants_upstream=lambda _: False
    )
    store.admission.admit_ready(10)
    assert store.attempts.claim(run_id, "a", 1, "w", 0.01, "t") is not None
    time.sleep(0.05)
    assert store.recovery.lose_lease(run_id, "a", 1, 10).accepted  # the reconciler takes it over
    orc = Orchestrator(
        Settings(lease_seconds=0.3, database_url=pg_clean),
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    return Heartbeater(orc), store, run_id


def test_main_thread_body_is_interrupted_inside_sleep(taken_over: tuple[Heartbeater, Store, str]) -> None:
    hb, _, run_id = taken_over
    hb.track(FencingToken(run_id, "a", 1))
    started = time.monotonic()
    with pytest.raises(LeaseLost):
        time.sleep(10)  # a blocking call: only a signal breaks it
    assert time.monotonic() - started < 2.0
    assert hb.untrack(FencingToken(run_id, "a", 1)) == "lost"  # the heartbeater already let go of it


def test_pool_thread_body_is_interrupted(taken_over: tuple[Heartbeater, Store, str]) -> None:
    hb, _, run_id = taken_over
    outcome: list[str] = []

    def body() -> None:
        hb.track(FencingToken(run_id, "a", 1))
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.05)
            outcome.append("ran to the end")
        except LeaseLost:
            outcome.append("fenced")

    thread = threading.Thread(target=body)
    started = time.monotonic()
    thread.start()
    thread.join(15)
    assert outcome == ["fenced"] and time.monotonic() - started < 2.0


@pytest.fixture
def queued(pg_clean: str) -> Iterator[tuple[Orchestrator, Store, str]]:
    """A run whose task ``a`` is QUEUED (attempt 1), and a driver of the worker's side."""
    store = Store(pg_clean)
    store.workers.register("w", default_queues(), 10)
    dag = DAG("direct")
    dag.task("a", "t")
    dag.task("b", "up", upstream=["a"])
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in "ab"}, wants_upstream=lambda name: name == "up"
    )
    sent = store.admission.admit_ready(10)
    assert [(d.key, d.direct) for d in sent] == [("a", True)]
    orc = Orchestrator(
        Settings(lease_seconds=3.0, claim_delay=0.2, database_url=pg_clean),
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t", "up"], upstream=["up"]),
    )
    yield orc, store, run_id
    # its hot-path sessions would be counted by the next test of the same database
    store.attempts.hot.close()
    store.dispose()


def _ledger(store: Store, run_id: str, key: str) -> list[tuple[str | None, str, bool]]:
    return [(e.from_state, e.to_state, e.accepted) for e in store.reads.events(run_id) if e.key == key]


def test_a_direct_body_that_finishes_before_its_claim_delay_commits_claim_and_success_at_once(
    queued: tuple[Orchestrator, Store, str],
) -> None:
    orc, store, run_id = queued
    token = FencingToken(run_id, "a", 1)
    hb = Heartbeater(orc)
    hb.track_direct(token, lambda: orc.claim(token, "w:1", "t") is not None)
    assert hb.untrack(token) == "unclaimed"
    out = orc.complete(token, 7, claim=("w:1", "t", 0.01))
    assert out.accepted
    # the child wants its upstream: not direct
    assert [(d.key, d.direct) for d in out.dispatches] == [("b", False)]
    assert _ledger(store, run_id, "a") == [
        ("PENDING", "READY", True), ("READY", "QUEUED", True), ("QUEUED", "RUNNING", True),
        ("RUNNING", "SUCCEEDED", True),
    ]  # fmt: skip
    # the same message delivered again: refused, recorded, nothing committed twice
    again = orc.complete(token, 8, claim=("w:2", "t", 0.01))
    assert not again.accepted and again.conflict == "row holds SUCCEEDED attempt 1"
    assert _ledger(store, run_id, "a")[-1] == ("SUCCEEDED", "RUNNING", False)
    assert {t.key: t.result for t in orc.tasks(run_id)}["a"] == 7
    # a task that is not direct is never claimed with its success
    b = FencingToken(run_id, "b", 1)
    assert not orc.complete(b, 1, claim=("w:1", "up", 0.01)).accepted
    assert {t.key: t.state.value for t in orc.tasks(run_id)}["b"] == "QUEUED"


def test_a_direct_body_that_outlives_its_claim_delay_is_claimed_from_the_heartbeat_thread(
    queued: tuple[Orchestrator, Store, str],
) -> None:
    orc, _, run_id = queued
    token = FencingToken(run_id, "a", 1)
    hb = Heartbeater(orc)
    hb.track_direct(token, lambda: orc.claim(token, "w:1", "t") is not None)
    # the heartbeat thread claims it once the claim delay passed: waited for in the database
    deadline = time.monotonic() + 60
    while {t.key: t.state.value for t in orc.tasks(run_id)}["a"] != "RUNNING":
        assert time.monotonic() < deadline, "the heartbeat thread never claimed the direct body"
        time.sleep(0.02)
    assert hb.untrack(token) == "held"
    assert orc.complete(token, 7).accepted


def test_a_direct_body_whose_delayed_claim_loses_is_stopped(queued: tuple[Orchestrator, Store, str]) -> None:
    orc, store, run_id = queued
    token = FencingToken(run_id, "a", 1)
    assert orc.claim(token, "other:1", "t") is not None  # a duplicate delivery claimed it first
    hb = Heartbeater(orc)
    hb.track_direct(token, lambda: orc.claim(token, "w:1", "t") is not None)
    started = time.monotonic()
    with pytest.raises(LeaseLost):
        time.sleep(10)
    assert time.monotonic() - started < 2.0
    assert hb.untrack(token) == "refused"
    assert _ledger(store, run_id, "a")[-1] == ("RUNNING", "RUNNING", False)
