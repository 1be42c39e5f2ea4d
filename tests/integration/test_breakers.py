"""Circuit breakers end to end: a real prefork worker (``-c 2``, its reconciler in its main
process) runs tasks of one tenant that call a fake resource (``tasks.probes.resource``) while
the test takes the resource down and up again (a Redis key). While it fails, only the attempts
already in flight at the trip and the half-open probes reach it; after it recovers, the backlog
drains in growing waves; another tenant's work runs meanwhile (its throughput printed beside its
throughput alone)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, RunState
from tests.integration.conftest import WorkerProcess, until

pytestmark = pytest.mark.integration
P = "tasks.probes."


def other_work(orc: Orchestrator, n: int) -> float:
    """Another tenant's run of ``n`` independent no-ops, start to end: its tasks per second."""
    dag = DAG("it-breaker-other", tenant="globex")
    for i in range(n):
        dag.task(f"n{i:03d}", P + "noop")
    started = time.monotonic()
    run = orc.submit(dag)
    until("the other tenant's run", lambda: run.status().state is RunState.SUCCEEDED, 120, 0.02)
    return n / (time.monotonic() - started)


def test_an_open_breaker_holds_its_resource_and_drains_in_waves(
    orc: Orchestrator, worker: WorkerProcess, redis_client: Any
) -> None:
    name = f"fakeapi-{uuid.uuid4().hex[:8]}"
    down, calls = f"orchestrator:fake:{name}:down", f"orchestrator:fake:{name}:calls"
    orc.breakers.set(
        name, window="60s", min_calls=3, min_failures=3, failure_rate=0.5, open_for="1s..2s", probes=1,
        probe_lease="30s", ramp_max=8,
    )  # fmt: skip
    alone = other_work(orc, 60)

    redis_client.set(down, 1)
    dag = DAG("it-breaker-pay", tenant="acme")
    for i in range(40):
        dag.task(
            f"c{i:03d}", P + "resource", kwargs={"name": name, "seconds": 0.15}, resources=[name],
            max_attempts=30, backoff={"base": 0.1, "cap": 0.3, "jitter": "none"},
        )  # fmt: skip
    run = orc.submit(dag)
    until("the breaker to open", lambda: orc.breakers.get(name).state != "closed", 60)
    during = other_work(orc, 60)  # while the resource is held
    # at least two probes fail (open 1 s, then 2 s)
    until(
        "two half-open probes",
        lambda: sum(1 for e in orc.breakers.events(name) if e.to_state == "half_open") >= 2,
        60,
    )
    assert run.status().state is RunState.RUNNING
    redis_client.delete(down)
    waves: list[int] = []

    def drained() -> bool:
        b = orc.breakers.get(name)
        if b.wave is not None and (not waves or waves[-1] != b.wave):
            waves.append(b.wave)
        return run.status().state is RunState.SUCCEEDED

    until("the backlog to drain", drained, 120, 0.01)

    events = orc.breakers.events(name)
    trip = next(e for e in events if e.to_state == "open")
    closed = next(e for e in events if e.to_state == "closed" and e.from_state == "half_open")
    half_opens = [e for e in events if e.to_state == "half_open" and e.at < closed.at]
    reopens = [e for e in events if e.from_state == "half_open" and e.to_state == "open"]
    # while it failed: admissions between the trip and the close are the probes only
    admitted_while_open = [
        e for e in run.events() if e.to_state == "QUEUED" and e.accepted and trip.at < e.at < closed.at
    ]
    down_calls = [c for c in redis_client.lrange(calls, 0, -1) if b" down " in c]
    window = 2 * 2  # the worker's capacity x dispatch depth: at most this many were in flight at the trip
    print(
        f"\nbreaker {name}: {len(down_calls)} calls reached the resource while down ({len(half_opens)} half-open,"
        f" {len(reopens)} re-opened), {len(admitted_while_open)} admitted while open; waves after closing {waves};"
        f"\nother tenant: {alone:.0f} tasks/s alone, {during:.0f} tasks/s while the breaker held"
        f" {len(dag.nodes)} tasks ({during / alone:.0%})"
    )
    assert len(admitted_while_open) <= len(half_opens)  # one probe permit per half-open
    assert len(down_calls) <= 3 + window + len(half_opens)
    assert len(reopens) >= 1 and len(half_opens) >= 2
    assert waves[:3] == [1, 2, 4] and waves == sorted(waves)
    assert orc.breakers.get(name).wave is None and orc.breakers.get(name).state == "closed"
    assert during > 0.3 * alone
    assert orc.verify([run.id]) == []
