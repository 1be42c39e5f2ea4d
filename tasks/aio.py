"""Coroutine task bodies (``async def``), for the tests of ``orchestrator/runtime/aio.py``.

Not in the default ``ORCHESTRATOR_TASK_MODULES``: a worker that runs them lists ``tasks.aio``.
Side effects go to the broker's Redis (``orchestrator:aio:<marker>``), where a test reads them.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from orchestrator.celery_app import get_app
from orchestrator.worker import current_context

app = get_app()

#: one Redis client per process (on the broker's Redis)
_redis: dict[str, Any] = {}


def _client(task: Any) -> Any:
    import redis

    url = str(task.app.conf.broker_url)
    client = _redis.get(url)
    if client is None:
        client = _redis[url] = redis.Redis.from_url(url)
    return client


def _note(task: Any, marker: str, what: str) -> None:
    """Append ``what`` to the list ``orchestrator:aio:<marker>``."""
    _client(task).rpush(f"orchestrator:aio:{marker}", what)


@app.task
async def number(n: int) -> int:
    """Return ``n`` after a turn of the event loop."""
    await asyncio.sleep(0.01)
    return n


@app.task
async def add_up(upstream: dict[str, Any], plus: int = 0) -> dict[str, Any]:
    """The sum of the parents' results (plus ``plus``), and who ran it: the attempt (from
    ``current_context()`` inside the coroutine), the process, thread and event loop."""
    await asyncio.sleep(0)
    ctx = current_context()
    return {
        "total": sum(int(v) for v in upstream.values()) + plus,
        "attempt": ctx.attempt if ctx else None,
        "where": where(),
    }


@app.task
async def whereami() -> dict[str, Any]:
    """The process, thread and event loop running this body."""
    await asyncio.sleep(0)
    return where()


def where() -> dict[str, Any]:
    return {"pid": os.getpid(), "thread": threading.get_ident(), "loop": id(asyncio.get_running_loop())}


@app.task(bind=True)
async def forever(self: Any, marker: str) -> None:
    """Await forever: note ``started`` once running, and, when cancelled, ``cancelled <why>``
    (the cancel's message: what stopped it) and ``finally``."""
    _note(self, marker, "started")
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError as exc:
        _note(self, marker, f"cancelled {' '.join(str(a) for a in exc.args)}")
        raise
    finally:
        _note(self, marker, "finally")


@app.task(bind=True)
async def stubborn(self: Any, marker: str) -> None:
    """Await forever, and go on awaiting once after its first cancel (noted ``ignored <why>``), as a
    body whose clean-up outlives its soft time limit; its second cancel is noted ``cancelled <why>``."""
    _note(self, marker, "started")
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError as exc:
        _note(self, marker, f"ignored {' '.join(str(a) for a in exc.args)}")
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError as exc:
        _note(self, marker, f"cancelled {' '.join(str(a) for a in exc.args)}")
        raise


@app.task(bind=True)
async def remember(self: Any, marker: str, a: int, b: int) -> int:
    """Return ``a + b``, noting it (a plain Celery call has no result backend to read)."""
    await asyncio.sleep(0.01)
    _note(self, marker, f"result {a + b}")
    return a + b
