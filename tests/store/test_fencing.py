"""Self-fencing: a body whose lease was taken over is stopped, even inside a blocking call."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.protocol import FencingToken
from orchestrator.publisher import RecordingPublisher
from orchestrator.registry import StaticRegistry
from orchestrator.routing import default_queues, route
from orchestrator.store import Store
from orchestrator.worker import Heartbeater, LeaseLost


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
    assert not hb.untrack(FencingToken(run_id, "a", 1))  # the heartbeater already let go of it


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
