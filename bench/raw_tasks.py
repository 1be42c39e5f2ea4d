"""Bench-only Celery tasks.

``bench.raw_noop`` and ``bench.raw_chain``: plain Celery tasks (not orchestrated) that count
their runs in Redis. ``bench.listing`` and ``bench.map_item``: orchestrated tasks of the map
scenarios (a source returning the items, and a no-op that takes the mapped keyword).

The raw tasks are registered on the project's app, so they run in the very same worker, with the
same settings (prefork, acks_late, prefetch multiplier 1), as the orchestrated ``tasks.probes.noop``.
Their base is plain :class:`celery.Task`, not ``OrchestratedTask``: no claim, no database.
Each execution does one Redis ``INCR`` (one local round trip) so the benchmark can tell,
cheaply and exactly, when the last task has run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Task

from orchestrator.runtime.celery_app import get_app

app = get_app()

RAW_TASK = "bench.raw_noop"
RAW_COUNTER = "orc-bench:raw:done"

_client: tuple[int, redis.Redis] | None = None


def _redis() -> redis.Redis:
    """One client per process (prefork children must not share the parent's sockets)."""
    global _client
    pid = os.getpid()
    if _client is None or _client[0] != pid:
        _client = (pid, redis.Redis.from_url(str(app.conf.broker_url)))
    return _client[1]


@app.task(name=RAW_TASK, base=Task, ignore_result=True)
def raw_noop() -> None:
    """Do nothing but count this execution."""
    _redis().incr(RAW_COUNTER)


RAW_CHAIN_TASK = "bench.raw_chain"
RAW_CHAIN_TIMES = "orc-bench:raw-chain:times"


@app.task(name=RAW_CHAIN_TASK, base=Task, ignore_result=True)
def raw_chain(index: int, length: int, queue: str) -> None:
    """One link of a plain Celery chain: record (index, body start, body end), send the next link.

    The next link is sent at the end of the body, as an orchestrated task publishes its
    children after its outcome is committed; times are this host's ``time.time()``.
    """
    start = time.time()
    if index + 1 < length:
        end = time.time()
        app.send_task(RAW_CHAIN_TASK, args=[index + 1, length, queue], queue=queue)
    else:
        end = time.time()
    _redis().rpush(RAW_CHAIN_TIMES, f"{index} {start!r} {end!r}")


LISTING_TASK = "bench.listing"
MAP_ITEM_TASK = "bench.map_item"


@app.task(name=LISTING_TASK)
def listing(n: int) -> list[int]:
    """An orchestrated task whose result is the list a map runs over: ``[0, 1, ..., n - 1]``."""
    return list(range(int(n)))


@app.task(name=MAP_ITEM_TASK)
def map_item(item: Any = None) -> Any:
    """An orchestrated no-op that takes the mapped keyword ``item`` and returns it (so a map
    chained over it gets the same item)."""
    return item
