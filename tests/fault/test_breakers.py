"""A circuit breaker's probe whose worker is SIGKILLed: the probe never returns, its lease
expires, and the reconciler counts it as a failure (the breaker opens again, then probes anew);
the breaker does not stay half-open, and the run finishes once the resource is back."""

from __future__ import annotations

import signal
import time

import sqlalchemy as sa

from orchestrator import DAG, RunState
from orchestrator.store import schema as s
from tests.fault.harness import Cluster, P


def test_a_killed_probe_does_not_leave_the_breaker_half_open(cluster: Cluster) -> None:
    name = "fakeapi"
    down, slow = f"orchestrator:fake:{name}:down", f"orchestrator:fake:{name}:slow"
    orc = cluster.orc
    orc.breakers.set(name, min_calls=1, min_failures=1, open_for="1s..2s", probes=1, probe_lease="3s", ramp_max=1)
    w1 = cluster.worker("w1")
    cluster.reconciler()
    cluster.redis.set(down, 1)
    dag = DAG("fault-breaker")
    for i in range(3):
        dag.task(
            f"c{i}", P + "resource", kwargs={"name": name}, resources=[name], max_attempts=10,
            backoff={"base": 0.1, "cap": 0.2, "jitter": "none"},
        )  # fmt: skip
    run = orc.submit(dag)
    cluster.wait_for(lambda: orc.breakers.get(name).state != "closed", 30, "the breaker to trip", run_id=run.id)
    # the breaker gates dispatch, not messages already sent: wait until every message sent before
    # it tripped has run (and failed against the down resource), so that no ordinary call, only
    # the probe, can start its body after the resource comes back (a loaded machine claims them late)
    in_flight = {"QUEUED", "RUNNING"}
    cluster.wait_for(
        lambda: not any(t.state.value in in_flight for t in cluster.store.reads.get_tasks(run.id)),
        30,
        "the calls sent before the trip to have failed",
        run_id=run.id,
    )
    # the resource answers again, but slowly: the next probe hangs in its body
    cluster.redis.set(slow, 60)
    cluster.redis.delete(down)

    def probe_running() -> bool:
        with cluster.store.engine.connect() as conn:
            probes = conn.execute(sa.select(s.breaker_probes.c.run_id, s.breaker_probes.c.key)).all()
        return any(run.task(key).state.value == "RUNNING" for _, key in probes)

    cluster.wait_for(probe_running, 30, "a probe running", run_id=run.id)
    w1.signal_group(signal.SIGKILL)  # the probe's worker dies: the probe never returns
    killed_at = time.monotonic()
    cluster.redis.delete(slow)

    def lease_counted() -> bool:
        return any("outlived its lease" in (e.reason or "") for e in orc.breakers.events(name))

    cluster.wait_for(lease_counted, 30, "the probe's lease counted as a failure", run_id=run.id)
    took = time.monotonic() - killed_at
    event = next(e for e in orc.breakers.events(name) if "outlived its lease" in (e.reason or ""))
    assert (event.from_state, event.to_state, event.actor) == ("half_open", "open", "reconciler")
    cluster.worker("w2")
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert orc.breakers.get(name).state == "closed"
    print(f"\nkilled probe counted as a failure {took:.1f}s after the kill (lease 3s)")
