"""Priority and fair share on both brokers: the same scenario against a real worker on Redis (the
suite's private redis-server) and on RabbitMQ (127.0.0.1:5672, a vhost of its own per test).
The admission order decides the run order, whatever the broker."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState
from tests.fault.harness import Cluster, P

pytestmark = pytest.mark.fault


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


def test_rabbitmq_queues_carry_the_priority_class(cluster: Cluster, broker: str) -> None:
    """On RabbitMQ the queues are priority queues and each message carries its class (9 high,
    5 default, 1 low); on Redis no priority is set (kombu would split a queue into lists)."""
    import subprocess

    from kombu import Connection, Exchange, Queue

    from orchestrator.core.protocol import message_priority

    cluster.configure(ORCHESTRATOR_BROKER_URL=broker, ORCHESTRATOR_WORKER_RECONCILER="0")
    w = cluster.worker("w1", concurrency=1)  # declares the queues
    w.stop()
    cluster.procs.remove(w)
    cluster.store.workers.register("ghost@fault", ["orchestrator.high", "orchestrator.low"], 2)  # admits, never takes
    dag = DAG("prio")
    dag.task("h", P + "noop", priority="high")
    dag.task("l", P + "noop", priority="low")
    cluster.orc.submit(dag)
    got: dict[str, int | None] = {}
    with Connection(broker) as conn:
        for queue in ("orchestrator.high", "orchestrator.low"):
            args = {"x-max-priority": 9} if broker.startswith("amqp") else {}
            declared = Queue(queue, Exchange(queue, type="direct"), routing_key=queue, queue_arguments=args)
            message = conn.SimpleQueue(declared).get(timeout=10)
            got[queue] = message.properties.get("priority")
            message.ack()
    if broker.startswith("amqp"):
        assert got == {"orchestrator.high": message_priority(0), "orchestrator.low": message_priority(2)}
        assert (message_priority(0), message_priority(1), message_priority(2)) == (9, 5, 1)
        vhost = broker.rsplit("/", 1)[1]
        listed = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "arguments"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        lines = [line for line in listed.splitlines() if line.startswith("orchestrator.")]
        assert lines and all("x-max-priority" in line and "9" in line for line in lines), listed
    else:
        assert set(got.values()) <= {None, 0}  # kombu reads "no priority" as 0 on Redis
