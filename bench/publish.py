"""The cost of one publish: Celery's ``send_task`` (as the orchestrator published before) against
the lean publish (:class:`orchestrator.core.publisher.CeleryPublisher`: one producer per batch,
the message's constant part built once per task name and stamped per attempt).

    python bench/publish.py [--n 5000] [--rounds 3] [--broker redis://127.0.0.1:6379/14] [--kombu-transport]

Publishes ``n`` messages of each kind per round, alternating, to a queue of its own on the
given broker (emptied before and after), and prints microseconds per publish (the median
round) and the ratio. Nothing consumes the messages.
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
    a = parser.parse_args()
    app = create_app(Settings.from_env({}, broker_url=a.broker, database_url="postgresql://unused/x"))
    if a.kombu_transport:  # before the first connection: the alias is looked up when one is made
        from kombu.transport import TRANSPORT_ALIASES

        TRANSPORT_ALIASES["redis"] = "kombu.transport.redis:Transport"
    lean = CeleryPublisher(app, lambda: KEY)
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
    print(f"publish of one message, {a.n} per round, {a.rounds} rounds, broker {a.broker} ({transport})")
    print(f"  send_task  {st:7.1f} us   rounds {', '.join(f'{x:.1f}' for x in times['send_task'])}")
    print(f"  lean       {ln:7.1f} us   rounds {', '.join(f'{x:.1f}' for x in times['lean'])}")
    print(f"  lean / send_task = {ln / st:.2f}   (purged {purged} messages)")


if __name__ == "__main__":
    main()
