"""The lean publish sends Celery's publish signals as ``send_task`` does, and a run's messages
carry the run's trace context with that context current while the signals fire (real Redis and
RabbitMQ; OpenTelemetry's Celery instrumentation and SDK in this process, uninstrumented after)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from celery import signals
from kombu import Connection

from orchestrator.core.config import Settings
from orchestrator.core.models import Dispatch
from orchestrator.core.publisher import CeleryPublisher
from orchestrator.engine.tracing import capture_trace_context
from orchestrator.runtime import tracing
from orchestrator.runtime.celery_app import create_app
from orchestrator.runtime.tracing import RunTraces, message_headers
from tests.conftest import IT_BROKER_URL

KEY = b"s" * 32
AMQP = "amqp://guest:guest@127.0.0.1:5672//"
RUN, OTHER = "a" * 32, "b" * 32
#: a client span's context (W3C): trace 0af7..., span b7ad...
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CARRIER = {"traceparent": TRACEPARENT}


def _app(broker: str, **settings: Any) -> Any:
    return create_app(Settings.from_env({}, broker_url=broker, database_url="postgresql://unused/x", **settings))


def _dispatches(queue: str) -> list[Dispatch]:
    return [
        Dispatch(RUN, "extract", 1, "tasks.probes.noop", [1, "two"], {"x": {"y": [1]}}, queue, None, 1800.0),
        Dispatch(OTHER, "load", 3, "tasks.probes.sleep", [], {}, queue, 10.0, 20.0, priority_rank=2),
    ]


def _received(app: Any, broker: str, queue: str, n: int) -> list[tuple[dict[str, Any], Any]]:
    with Connection(broker) as conn:
        q = conn.SimpleQueue(app.amqp.queues[queue], no_ack=True)
        try:
            return [(m.headers, m.decode()) for m in (q.get(timeout=5) for _ in range(n))]
        finally:
            q.clear()
            q.close()


def _delete(app: Any, broker: str, queue: str) -> None:
    with Connection(broker) as conn:
        app.amqp.queues[queue].bind(conn.default_channel).delete()


class Recorder:
    """Receivers of both publish signals: what each got, and the trace id current in each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def before(self, **kw: Any) -> None:
        kw["headers"]["x-added-by-receiver"] = "yes"  # a receiver may add headers
        self.calls.append(("before", kw))

    def after(self, **kw: Any) -> None:
        self.calls.append(("after", kw))

    def __enter__(self) -> Recorder:
        signals.before_task_publish.connect(self.before, weak=False)
        signals.after_task_publish.connect(self.after, weak=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        signals.before_task_publish.disconnect(self.before)
        signals.after_task_publish.disconnect(self.after)


def _comparable(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, kw in calls:
        kw = {k: v for k, v in kw.items() if k != "signal"}
        if "declare" in kw:
            kw["declare"] = [q.name for q in kw["declare"]]
        out.append((name, kw))
    return out


@pytest.mark.parametrize("broker", [IT_BROKER_URL, AMQP], ids=["redis", "rabbitmq"])
def test_the_lean_publish_sends_the_signals_send_task_sends(broker: str) -> None:
    queue = f"orchestrator.test.signals.{uuid.uuid4().hex[:8]}"
    app = _app(broker)
    got: dict[str, Any] = {}
    try:
        for way in ("send_task", "lean"):
            publisher = CeleryPublisher(app, lambda: KEY)
            publisher.traces = None  # the signals alone (the trace context: the tests below)
            if way == "send_task":
                publisher.lean = None
            with Recorder() as rec:
                assert publisher.publish(_dispatches(queue)) == 2
            got[way] = (_comparable(rec.calls), _received(app, broker, queue, 2))
    finally:
        _delete(app, broker, queue)
    assert got["lean"] == got["send_task"]
    calls, messages = got["lean"]
    assert [name for name, _ in calls] == ["before", "after", "before", "after"]
    before = calls[0][1]
    assert before["sender"] == "tasks.probes.noop" and before["routing_key"] == queue and before["exchange"] == ""
    assert before["body"] == (
        [1, "two"],
        {"x": {"y": [1]}},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    )
    assert before["declare"] == [queue] and before["properties"]["correlation_id"] == f"{RUN}.extract.1"
    assert set(before["retry_policy"]) >= {"max_retries", "interval_start"}
    if broker == AMQP:
        assert calls[2][1]["properties"]["priority"] == 1  # the low class's message priority
    # what the receiver added is in the messages
    assert all(headers["x-added-by-receiver"] == "yes" for headers, _ in messages)


def test_no_receiver_no_signal_arguments_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a receiver the lean publish does not call the signals at all."""
    queue = f"orchestrator.test.signals.{uuid.uuid4().hex[:8]}"
    app = _app(IT_BROKER_URL)
    sent: list[str] = []
    monkeypatch.setattr(signals.before_task_publish, "send", lambda **kw: sent.append("before"))
    monkeypatch.setattr(signals.after_task_publish, "send", lambda **kw: sent.append("after"))
    assert not tracing.receivers()
    try:
        assert CeleryPublisher(app, lambda: KEY).publish(_dispatches(queue)) == 2
        assert len(_received(app, IT_BROKER_URL, queue, 2)) == 2
    finally:
        _delete(app, IT_BROKER_URL, queue)
    assert sent == []


class FakeRead:
    def __init__(self, carriers: Mapping[str, Mapping[str, str] | None]) -> None:
        self.carriers = carriers
        self.asked: list[list[str]] = []

    def __call__(self, run_ids: Any) -> Mapping[str, Mapping[str, str] | None]:
        self.asked.append(sorted(run_ids))
        return {r: self.carriers[r] for r in run_ids if r in self.carriers}


def test_run_traces_read_once_per_run_and_only_while_tracing_is_on() -> None:
    app = _app(IT_BROKER_URL)
    read = FakeRead({RUN: CARRIER, OTHER: None})
    traces = RunTraces(app, read, size=2)
    assert traces.lookup([RUN]) is None and read.asked == []  # tracing off here: nothing read
    with Recorder():
        found = traces.lookup([RUN, OTHER])
        assert found is not None and found[RUN].headers == CARRIER and found[OTHER].headers == {}
        assert traces.lookup([RUN, OTHER]) is not None  # OTHER the most recent
        assert read.asked == [[RUN, OTHER]]  # one query for both, then the cache
        traces.lookup(["c" * 32])  # a third run: the least recent (RUN) goes
        traces.lookup([RUN])
        assert read.asked[1:] == [["c" * 32], [RUN]]

        def broken(run_ids: Any) -> Any:
            raise OSError("database down")

        traces = RunTraces(app, broken)
        found = traces.lookup([RUN])
        assert found == {}  # published without a context, asked again next time


def test_sentry_headers_go_in_the_nested_headers_too() -> None:
    carrier = {"traceparent": TRACEPARENT, "sentry-trace": "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
               "baggage": "sentry-trace_id=0af7651916cd43dd8448eb211c80319c"}  # fmt: skip
    headers = message_headers(carrier)
    assert headers["headers"] == {"sentry-trace": carrier["sentry-trace"], "baggage": carrier["baggage"]}
    assert {k: headers[k] for k in carrier} == carrier
    assert message_headers(CARRIER) == CARRIER and message_headers(None) == {}


@pytest.fixture
def otel() -> Iterator[Any]:
    """OpenTelemetry's Celery instrumentation in this process, on a provider of its own (the
    global one is left alone), exporting to memory; uninstrumented after."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    CeleryInstrumentor().instrument(tracer_provider=provider)
    try:
        yield provider, exporter
    finally:
        CeleryInstrumentor().uninstrument()


@pytest.mark.parametrize("way", ["lean", "send_task"])
def test_a_runs_messages_are_published_in_its_trace(otel: Any, way: str) -> None:
    """OpenTelemetry's producer span of each message is a child of its run's stored context (the
    submitter's span), and the message carries that producer span as its ``traceparent``; a run
    without a context gets a trace of its own, not the publisher's current span."""
    from opentelemetry import trace

    provider, exporter = otel
    queue = f"orchestrator.test.trace.{uuid.uuid4().hex[:8]}"
    app = _app(IT_BROKER_URL)
    app.loader.import_default_modules()  # the tasks registered, as in a submitter or a worker
    publisher = CeleryPublisher(app, lambda: KEY, traces=RunTraces(app, FakeRead({RUN: CARRIER, OTHER: None})))
    if way == "send_task":
        publisher.lean = None
    try:
        with provider.get_tracer("test").start_as_current_span("unrelated publisher work") as ambient:
            assert publisher.publish(_dispatches(queue)) == 2
            assert trace.get_current_span() is ambient  # the publisher's own context is back
        messages = _received(app, IT_BROKER_URL, queue, 2)
    finally:
        _delete(app, IT_BROKER_URL, queue)
    producers = {
        s.attributes["messaging.message.id"]: s for s in exporter.get_finished_spans() if s.kind.name == "PRODUCER"
    }
    traced, untraced = producers[f"{RUN}.extract.1"], producers[f"{OTHER}.load.3"]
    assert traced.context.trace_id == int(TRACEPARENT.split("-")[1], 16)
    assert traced.parent is not None and traced.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
    assert untraced.parent is None and untraced.context.trace_id != ambient.get_span_context().trace_id
    headers = messages[0][0]
    assert headers["traceparent"].startswith(f"00-{traced.context.trace_id:032x}-{traced.context.span_id:016x}-")


def test_capture_trace_context() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    assert capture_trace_context() is None  # no span, no Sentry
    with TracerProvider().get_tracer("test").start_as_current_span("client") as span:
        ctx = span.get_span_context()
        carrier = capture_trace_context()
    assert carrier is not None and set(carrier) == {"traceparent"}
    assert carrier["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")


def test_capture_without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OpenTelemetry installed (its import fails) and no Sentry: nothing is captured."""
    from orchestrator.engine import tracing as engine_tracing

    monkeypatch.setattr(engine_tracing, "_propagate", None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import opentelemetry -> ImportError
    monkeypatch.delitem(sys.modules, "sentry_sdk", raising=False)
    assert capture_trace_context() is None
    assert engine_tracing._propagate is False  # asked once


def test_send_task_keeps_the_runs_sentry_trace() -> None:
    """With task events on (``send_task``) and Sentry's Celery integration active in the
    publisher, the message carries the run's Sentry trace, not the publisher's own."""
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.transport import Transport

    class Nowhere(Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            pass

    sentry_trace = "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1"
    carrier = {"sentry-trace": sentry_trace, "baggage": "sentry-trace_id=0af7651916cd43dd8448eb211c80319c"}
    queue = f"orchestrator.test.sentry.{uuid.uuid4().hex[:8]}"
    app = _app(IT_BROKER_URL, task_events=True)
    sentry_sdk.init(
        dsn="http://public@127.0.0.1:9/1", transport=Nowhere, traces_sample_rate=1.0,
        integrations=[CeleryIntegration()], default_integrations=False,
    )  # fmt: skip
    try:
        publisher = CeleryPublisher(app, lambda: KEY, traces=RunTraces(app, FakeRead({RUN: carrier})))
        assert publisher.lean is None
        with sentry_sdk.start_transaction(name="the publisher's own work"):
            assert publisher.publish(_dispatches(queue)[:1]) == 1
        (headers, _), *_ = _received(app, IT_BROKER_URL, queue, 1)
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.get_global_scope().set_client(None)
        _delete(app, IT_BROKER_URL, queue)
    assert headers["sentry-trace"] == sentry_trace and headers["headers"]["sentry-trace"] == sentry_trace
    assert "sentry-propagate-traces" not in headers  # Sentry's wrapper took it
