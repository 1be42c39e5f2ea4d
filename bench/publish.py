"""The cost of one publish: Celery's ``send_task`` (as the orchestrator published before) against
the lean publish (:class:`orchestrator.core.publisher.CeleryPublisher`: one producer per batch,
the message's constant part built once per task name and stamped per attempt).

    python bench/publish.py [--n 5000] [--rounds 3] [--broker redis://127.0.0.1:6379/14] [--kombu-transport]
                            [--receivers | --otel]
    python bench/publish.py --cpu


Publishes ``n`` messages of each kind per round, alternating, to a queue of its own on the
given broker (emptied before and after), and prints microseconds per publish (the median
round) and the ratio. Nothing consumes the messages.

``--receivers`` connects a receiver that does nothing to ``before_task_publish`` and
``after_task_publish`` (both ways then send the signals with their arguments; without a receiver
the lean publish does not build them). ``--otel`` instruments the publish with OpenTelemetry's
Celery instrumentation (an SDK tracer provider whose spans go nowhere) and gives every message a
run with a stored trace context (read once, from memory): what a traced deployment pays.

``--cpu`` times ``LeanSender.send`` alone on a producer that sends nothing (50,000 calls, the
median of 5): no receivers, the signals sent with none (forced: what sending them always would
cost), do-nothing receivers, and those with a run's trace context made current.
"""

from __future__ import annotations

import argparse
import statistics
import time

from orchestrator.core.config import Settings
from orchestrator.core.models import Dispatch
from orchestrator.core.protocol import send_options, sign
from orchestrator.core.publisher import CeleryPublisher
from orchestrator.runtime.celery_app import create_app
from orchestrator.runtime.tracing import RunTraces

KEY = b"k" * 32
QUEUE = "orchestrator.bench.publish"


def dispatches(n: int, round_: int, kind: str) -> list[Dispatch]:
    return [
        Dispatch(f"{kind}{round_:02d}{'0' * 20}", f"m{i}", 1, "tasks.probes.noop", [], {}, QUEUE, None, 1800.0)
        for i in range(n)
    ]


def send_task_way(app: object, batch: list[Dispatch]) -> None:
    with app.producer_or_acquire() as producer:  # type: ignore[attr-defined]
        for d in batch:
            app.send_task(  # type: ignore[attr-defined]
                d.task_name,
                args=d.args,
                kwargs=d.kwargs,
                producer=producer,
                **send_options(
                    d.token,
                    queue=d.queue,
                    soft_time_limit=d.soft_time_limit,
                    time_limit=d.time_limit,
                    signature=sign(KEY, d.task_name, d.token),
                ),
            )


def _nothing(**kwargs: object) -> None:
    pass


def _instrument(app: object, lean: CeleryPublisher, receivers: bool, otel: bool) -> None:
    """Connect do-nothing receivers, or OpenTelemetry's instrumentation and the runs' traces."""
    from celery import signals

    if receivers:
        signals.before_task_publish.connect(_nothing, weak=False)
        signals.after_task_publish.connect(_nothing, weak=False)
        lean.traces = RunTraces(app, lambda ids: {})  # runs without a trace context, read once
    if otel:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.trace import TracerProvider

        app.loader.import_default_modules()  # type: ignore[attr-defined]
        CeleryInstrumentor().instrument(tracer_provider=TracerProvider())
        carrier = {"traceparent": TRACEPARENT}
        lean.traces = RunTraces(app, lambda ids: dict.fromkeys(ids, carrier))


class _Channel:
    pass


class _Producer:
    channel = _Channel()

    def publish(self, body: object, **kwargs: object) -> None:
        pass


class _Always(list):  # type: ignore[type-arg]
    def __bool__(self) -> bool:
        return True


def cpu(app: object) -> None:
    """Microseconds of CPU per ``LeanSender.send`` (see the module's docstring)."""
    from celery import signals

    from orchestrator.runtime.tracing import RunTrace

    sender = app.orchestrator_lean_sender  # type: ignore[attr-defined]
    producer, d = _Producer(), dispatches(1, 0, "c")[0]

    def timed(label: str, trace: RunTrace | None = None) -> None:
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50_000):
                sender.send(producer, d, "signature", None, trace)
            runs.append((time.perf_counter() - t) / 50_000 * 1e6)
        print(f"  {label:48s} {statistics.median(runs):6.2f} us")

    print("CPU of LeanSender.send on a producer that sends nothing")
    timed("no receivers")
    before = signals.before_task_publish
    before.receivers, real = _Always(before.receivers), before.receivers
    timed("signals sent without receivers (forced)")
    before.receivers = real
    before.connect(_nothing, weak=False)
    signals.after_task_publish.connect(_nothing, weak=False)
    timed("do-nothing receivers")
    import opentelemetry.context  # noqa: F401 - the API loaded, as where it is used

    timed("do-nothing receivers, the run's context current", RunTrace({"traceparent": TRACEPARENT}))


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/14")
    parser.add_argument(
        "--kombu-transport",
        action="store_true",
        help="kombu's own Redis transport (a client object per command), as before orchestrator.runtime.redisbroker",
    )
    parser.add_argument("--receivers", action="store_true", help="a do-nothing receiver of both publish signals")
    parser.add_argument("--otel", action="store_true", help="OpenTelemetry's Celery instrumentation, traced runs")
    parser.add_argument("--cpu", action="store_true", help="the CPU of one lean send alone, no broker")
    a = parser.parse_args()
    app = create_app(Settings.from_env({}, broker_url=a.broker, database_url="postgresql://unused/x"))
    if a.cpu:
        return cpu(app)
    if a.kombu_transport:  # before the first connection: the alias is looked up when one is made
        from kombu.transport import TRANSPORT_ALIASES

        TRANSPORT_ALIASES["redis"] = "kombu.transport.redis:Transport"
    lean = CeleryPublisher(app, lambda: KEY)
    _instrument(app, lean, a.receivers, a.otel)
    times: dict[str, list[float]] = {"send_task": [], "lean": []}
    # one warm-up of each (connections, queue declaration)
    send_task_way(app, dispatches(50, 99, "w"))
    lean.publish(dispatches(50, 98, "x"))
    for r in range(a.rounds):
        batch = dispatches(a.n, r, "s")
        t = time.perf_counter()
        send_task_way(app, batch)
        times["send_task"].append((time.perf_counter() - t) / a.n * 1e6)
        batch = dispatches(a.n, r, "l")
        t = time.perf_counter()
        assert lean.publish(batch) == a.n
        times["lean"].append((time.perf_counter() - t) / a.n * 1e6)
    with app.connection_for_write() as conn:
        purged = conn.default_channel.queue_purge(QUEUE)
    st, ln = statistics.median(times["send_task"]), statistics.median(times["lean"])
    transport = type(app.connection_for_write().transport).__module__
    mode = "OpenTelemetry" if a.otel else "do-nothing receivers" if a.receivers else "no receivers"
    print(f"publish of one message, {a.n} per round, {a.rounds} rounds, broker {a.broker} ({transport}), {mode}")
    print(f"  send_task  {st:7.1f} us   rounds {', '.join(f'{x:.1f}' for x in times['send_task'])}")
    print(f"  lean       {ln:7.1f} us   rounds {', '.join(f'{x:.1f}' for x in times['lean'])}")
    print(f"  lean / send_task = {ln / st:.2f}   (purged {purged} messages)")


if __name__ == "__main__":
    main()
