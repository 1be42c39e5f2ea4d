"""Tasks of the kit's own tests, on the project's app (``get_app()``), as a user's would be.
``CALLS`` records every body that ran: (task, attempt, kwargs)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator import Defer
from orchestrator.runtime.celery_app import get_app
from orchestrator.runtime.worker import current_context

app = get_app()
CALLS: list[tuple[str, int, dict[str, Any]]] = []


def _called(name: str, **kwargs: Any) -> None:
    ctx = current_context()
    CALLS.append((name, ctx.attempt if ctx else 0, kwargs))


@app.task(name="kit.value")
def value(x: Any = 1) -> Any:
    _called("value", x=x)
    return x


@app.task(name="kit.total")
def total(upstream: dict[str, Any]) -> float:
    _called("total")
    found = 0.0
    for v in upstream.values():
        found += sum(v) if isinstance(v, list) else (v or 0)
    return found


@app.task(name="kit.charge")
def charge(amount: float) -> dict[str, Any]:
    _called("charge", amount=amount)
    return {"charged": amount}


@app.task(name="kit.listing")
def listing(n: int = 3) -> list[int]:
    _called("listing", n=n)
    return list(range(1, n + 1))


@app.task(name="kit.square")
def square(item: int) -> int:
    _called("square", item=item)
    return item * item


@app.task(name="kit.pick")
def pick(upstream: dict[str, Any], big: str = "big", small: str = "small") -> str:
    _called("pick")
    return big if sum(upstream["squares"]) > 10 else small


@app.task(name="kit.when")
def when() -> dt.datetime:
    """A result that is no JSON: a datetime."""
    _called("when")
    return dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@app.task(name="kit.ready_after")
def ready_after(checks: int = 3) -> dict[str, Any] | None:
    """A sensor's check: "not yet" until its ``checks``-th call."""
    ctx = current_context()
    done = int(((ctx.resumed or {}).get("state") or {}).get("checks", 0)) if ctx else 0
    _called("ready_after", check=done + 1)
    return {"after_checks": done + 1} if done + 1 >= checks else None


@app.task(name="kit.later")
def later(hours: float = 6) -> dict[str, Any]:
    """Defers itself once for ``hours``, then returns what it was resumed with."""
    ctx = current_context()
    _called("later", resumed=ctx.resumed if ctx else None)
    if ctx is not None and ctx.resumed is None:
        raise Defer(delay=hours * 3600, state={"first_attempt": ctx.attempt})
    return {"resumed": ctx.resumed if ctx else None}


@app.task(name="kit.slow")
def slow(seconds: float = 1.0) -> float:
    """A body that outlives a third of its lease: the worker's heartbeater extends it."""
    import time

    _called("slow", seconds=seconds)
    time.sleep(seconds)
    return seconds
