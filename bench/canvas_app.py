"""Bench-only: a plain Celery app with a Redis result backend, for the Celery canvas reference
(a chord 1 -> N -> 1 and a chain of N), run by a second worker with the bench worker's settings
(prefork, acks_late, prefetch multiplier 1, JSON) after the orchestrated phases.

Chords need a result backend; the project's app has none (the database is the source of
truth), so the canvas gets its own app. The broker is the bench's Redis database; the backend
is the next database number.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

BROKER = os.environ.get("ORCHESTRATOR_BROKER_URL", "redis://127.0.0.1:6379/9")
QUEUE = "bench.canvas"
DONE_KEY = "orc-bench:canvas:done"


def backend_url(broker: str) -> str:
    base, _, db = broker.rpartition("/")
    return f"{base}/{int(db or 0) + 1}"


app = Celery("bench_canvas", broker=BROKER, backend=backend_url(BROKER), set_as_current=False)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    result_expires=600,
)

_client: tuple[int, redis.Redis] | None = None


def _redis() -> redis.Redis:
    global _client
    pid = os.getpid()
    if _client is None or _client[0] != pid:
        _client = (pid, redis.Redis.from_url(BROKER))
    return _client[1]


@app.task(name="bench.canvas.noop")
def noop(*_: object) -> None:
    """Do nothing (its result, None, is stored for the chord)."""
    return None


@app.task(name="bench.canvas.done")
def done(*_: object) -> None:
    """The chord's callback, or the chain's last link: note the time it ran."""
    _redis().incr(DONE_KEY)
