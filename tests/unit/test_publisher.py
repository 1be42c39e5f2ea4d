"""The lean publish sends the very message ``send_task`` sends (headers, properties and body),
on Redis and on RabbitMQ (with its message priorities), real servers both."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kombu import Connection

from orchestrator.core.config import Settings
from orchestrator.core.models import Dispatch
from orchestrator.core.publisher import CeleryPublisher
from orchestrator.runtime.celery_app import create_app
from tests.conftest import REDIS_BASE

KEY = b"s" * 32
AMQP = "amqp://guest:guest@127.0.0.1:5672//"


Message = tuple[dict[str, Any], dict[str, Any], Any]
SKIPPED = {"delivery_tag", "delivery_info", "body_encoding"}


def _messages(app: Any, broker: str, dispatches: list[Dispatch], *, lean: bool) -> list[Message]:
    publisher = CeleryPublisher(app, lambda: KEY)
    assert publisher.lean is not None
    if not lean:
        publisher.lean = None  # send_task
    assert publisher.publish(dispatches) == len(dispatches)
    got = []
    with Connection(broker) as conn:
        queue = conn.SimpleQueue(app.amqp.queues[dispatches[0].queue], no_ack=True)
        try:
            for _ in dispatches:
                m = queue.get(timeout=5)
                props = {k: v for k, v in m.properties.items() if k not in SKIPPED}
                got.append((m.headers, props, m.decode()))
        finally:
            queue.clear()
            queue.close()
    return got


@pytest.mark.parametrize("broker", [f"{REDIS_BASE}/13", AMQP], ids=["redis", "rabbitmq"])
@pytest.mark.parametrize(
    "args,kwargs", [([], {}), ([1, "two"], {"x": {"y": [1, 2, 3]}})], ids=["from the database", "in the message"]
)
def test_the_lean_message_is_send_tasks_message(broker: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    queue = f"orchestrator.test.publish.{uuid.uuid4().hex[:8]}"
    ds = [
        Dispatch("r" * 32, "extract", 1, "tasks.probes.noop", args, kwargs, queue, None, 1800.0),
        Dispatch("r" * 32, "load", 3, "tasks.probes.sleep", args, kwargs, queue, 10.0, 20.0, priority_rank=2),
    ]
    app = create_app(Settings.from_env({}, broker_url=broker, database_url="postgresql://unused/x"))
    try:
        slow = _messages(app, broker, ds, lean=False)
        lean = _messages(app, broker, ds, lean=True)
    finally:
        with Connection(broker) as conn:
            app.amqp.queues[queue].bind(conn.default_channel).delete()
    assert lean == slow
    headers, props, body = lean[1]
    assert headers["id"] == headers["root_id"] == f"{'r' * 32}.load.3" and headers["timelimit"] == [20.0, 10.0]
    assert (headers["orc_run"], headers["orc_key"], headers["orc_attempt"]) == ("r" * 32, "load", 3)
    assert props["correlation_id"] == headers["id"] and body[:2] == [args, kwargs]


def test_task_events_keep_send_task() -> None:
    app = create_app(
        Settings.from_env({}, broker_url=f"{REDIS_BASE}/13", database_url="postgresql://unused/x", task_events=True)
    )
    assert CeleryPublisher(app, lambda: KEY).lean is None


def test_several_messages_go_to_redis_in_one_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A completion's dispatches reach Redis in one round trip (kombu's producer batch): 50
    messages, one pipeline executed, every message in its queue in order."""
    import redis.client

    broker = f"{REDIS_BASE}/13"
    queue = f"orchestrator.test.batch.{uuid.uuid4().hex[:8]}"
    ds = [Dispatch("r" * 32, f"k{i}", 1, "tasks.probes.noop", [], {}, queue, None, 60.0) for i in range(50)]
    app = create_app(Settings.from_env({}, broker_url=broker, database_url="postgresql://unused/x"))
    executed: list[int] = []
    original = redis.client.Pipeline.execute

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        executed.append(len(self.command_stack))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    try:
        assert CeleryPublisher(app, lambda: KEY).publish(ds) == 50
        monkeypatch.setattr(redis.client.Pipeline, "execute", original)
        with Connection(broker) as conn:
            q = conn.SimpleQueue(app.amqp.queues[queue], no_ack=True)
            try:
                keys = [q.get(timeout=5).headers["orc_key"] for _ in ds]
            finally:
                q.close()
    finally:
        with Connection(broker) as conn:
            app.amqp.queues[queue].bind(conn.default_channel).delete()
    assert keys == [f"k{i}" for i in range(50)]
    assert [n for n in executed if n >= 50] == [50], executed  # the 50 LPUSHes in one pipeline
