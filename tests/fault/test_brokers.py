"""Priority and fair share on both brokers: the same scenario against a real worker on Redis (the
suite's private redis-server) and on RabbitMQ (127.0.0.1:5672, a vhost of its own per test).
The admission order decides the run order, whatever the broker."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState
from tests.fault.harness import Cluster, P

pytestmark = pytest.mark.fault


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"rabbitmqctl {' '.join(args)} failed: {done.stderr}{done.stdout}")


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[str]:
    if request.param == "redis":
        yield cluster.settings.broker_url
        return
    vhost = f"orc-test-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)  # its queues go with it


def _started_order(cluster: Cluster, run_ids: list[str]) -> list[tuple[str, str]]:
    """(run id, key) of the tasks of these runs in the order they started (database time)."""
    with cluster.store.engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "select run_id, key from orc_tasks where run_id = any(:r) and started_at is not null"
                " order by started_at, run_id, key"
            ),
            {"r": run_ids},
        ).all()
    return [(r, k) for r, k in found]


def test_priority_then_fair_share_decide_the_order(cluster: Cluster, broker: str) -> None:
    # depth 1: one message in the broker at a time, so the start order is the admission order
    # (with more, a worker polling several queues takes them in the broker's own order)
    cluster.configure(
        ORCHESTRATOR_BROKER_URL=broker, ORCHESTRATOR_WORKER_RECONCILER="0", ORCHESTRATOR_DISPATCH_DEPTH="1"
    )
    # the backlog is in the database before any worker exists: nothing is admitted yet
    runs: dict[str, str] = {}
    for name, tenant, priority in (
        ("low", "t1", "low"),
        ("default-1", "t1", "default"),
        ("default-2", "t2", "default"),
        ("high", "t2", "high"),
    ):
        dag = DAG(name, tenant=tenant, priority=priority)
        for i in range(6):
            dag.task(f"{name}-{i}", P + "noop")
        runs[name] = cluster.orc.submit(dag).id
    cluster.worker("w1", concurrency=1)  # one slot: strictly one task after another
    for run_id in runs.values():
        assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
    by_run = {v: k for k, v in runs.items()}
    order = [by_run[r] for r, _ in _started_order(cluster, list(runs.values()))]
    # high first, low last (no aging within seconds)
    assert order[:6] == ["high"] * 6, order
    assert order[-6:] == ["low"] * 6, order
    # in between, the default class is shared by the two tenants: they alternate, never one
    # tenant's whole run before the other's
    middle = order[6:18]
    assert sorted(middle) == ["default-1"] * 6 + ["default-2"] * 6
    first_half = middle[:6]
    assert 2 <= first_half.count("default-1") <= 4, middle
