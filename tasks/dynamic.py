"""Tasks for dynamic DAGs (maps, branches, skips): used by the tests and the chaos soak.

A listing to map over, item tasks for a map's children (one stage of a chained map takes the
previous stage's result as its item), a join that receives a map's results, a branch chooser
and a task that skips itself. Like the probes, each body records its execution in
``orc_probe_effects`` when ``ORCHESTRATOR_RECORD_PROBE_EFFECTS`` is on.
"""

from __future__ import annotations

import os
import time
from typing import Any

from orchestrator import Skip
from orchestrator.celery_app import get_app
from orchestrator.runtime.process import current_orchestrator
from orchestrator.store.probes import record_effect
from orchestrator.worker import current_context

app = get_app()


class ItemFailure(RuntimeError):
    """Raised by :func:`item` for the items it is told to fail."""


def _effect() -> None:
    """Record this execution (run, key, attempt, pid) when ORCHESTRATOR_RECORD_PROBE_EFFECTS is on."""
    ctx = current_context()
    if ctx is None:
        return
    orc = current_orchestrator(app)
    if orc.settings.record_probe_effects:
        record_effect(orc.store.engine, ctx.run_id, ctx.key, ctx.attempt, os.getpid())


@app.task(bind=True)
def listing(self: Any, n: int = 3, seconds: float = 0.0) -> list[int]:
    """The list ``[0, 1, ..., n - 1]`` (after ``seconds``): what a map maps over."""
    _effect()
    time.sleep(float(seconds))
    return list(range(int(n)))


@app.task(bind=True)
def item(self: Any, x: Any = None, add: int = 0, seconds: float = 0.0, skip_every: int = 0, fail_every: int = 0) -> Any:
    """One map child: ``x + add`` (``x`` unchanged when it is not a number), after ``seconds``.

    ``skip_every=k``: an integer item divisible by ``k`` raises :class:`orchestrator.Skip`;
    ``fail_every=k``: one divisible by ``k`` (and not skipped) raises :class:`ItemFailure`.
    """
    _effect()
    if seconds:
        time.sleep(float(seconds))
    if isinstance(x, int) and skip_every and x % int(skip_every) == 0:
        raise Skip(f"item {x} is skipped (every {skip_every})")
    if isinstance(x, int) and fail_every and x % int(fail_every) == 0:
        raise ItemFailure(f"item {x} fails (every {fail_every})")
    return x + int(add) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


@app.task(bind=True)
def collect(self: Any, upstream: dict[str, Any] | None = None, seconds: float = 0.0) -> dict[str, Any]:
    """A join: return the parents' results (a map's: the list of its children's, in map order)."""
    _effect()
    if seconds:
        time.sleep(float(seconds))
    return dict(upstream or {})


@app.task(bind=True)
def times(self: Any, x: Any = 0, by: int = 2) -> Any:
    """One map child: ``x * by``."""
    _effect()
    return x * int(by)


@app.task
def as_item_kwargs(pair: Any) -> dict[str, Any]:
    """A map's transform (``DAG.map(transform=...)``, Airflow's ``.map(fn)``): a ``[name, value]``
    pair as :func:`item`'s keyword arguments, ``add`` the name's length; a ``None`` value skips
    its child (:class:`orchestrator.Skip`)."""
    name, value = pair
    if value is None:
        raise Skip(f"{name} has no value")
    return {"x": value, "add": len(name)}


@app.task(bind=True)
def choose(self: Any, pick: str | list[str] = "") -> str | list[str]:
    """A branch: return the child key(s) to follow."""
    _effect()
    return pick


@app.task(bind=True)
def skip(self: Any, reason: str = "nothing to do") -> None:
    """Raise :class:`orchestrator.Skip`: the task ends SKIPPED."""
    _effect()
    raise Skip(reason)


class GateClosed(RuntimeError):
    """Raised by :func:`gated` while its flag file does not exist."""


@app.task(bind=True)
def gated(self: Any, flag: str = "", first_seconds: float = 0.0) -> dict[str, Any]:
    """Fail with :class:`GateClosed` while the file ``flag`` does not exist (a bug an operator
    fixes before clearing the task), else return the attempt and the process that ran it. The
    first attempt sleeps ``first_seconds`` before that (a body to kill or clear while it runs);
    later attempts do not."""
    _effect()
    ctx = current_context()
    attempt = ctx.attempt if ctx else 1
    if first_seconds and attempt == 1:
        time.sleep(float(first_seconds))
    if flag and not os.path.exists(flag):
        raise GateClosed(f"{flag} does not exist yet (attempt {attempt})")
    return {"attempt": attempt, "pid": os.getpid()}


if app.orchestrator_settings.hazard_probes:
    # only where asked for (ORCHESTRATOR_HAZARD_PROBES=1), as the hazardous probes

    @app.task(bind=True)
    def stubborn(self: Any, seconds: float = 5.0) -> dict[str, Any]:
        """Sleep ``seconds`` ignoring SIGTERM (a revoke with terminate) and swallowing
        :class:`orchestrator.worker.LeaseLost`, then return anyway: a body that will not be stopped,
        whose late result the orchestrator must refuse once its attempt was fenced."""
        import signal

        from orchestrator.worker import LeaseLost

        _effect()
        ctx = current_context()
        interrupted = 0
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            deadline = time.monotonic() + float(seconds)
            while (left := deadline - time.monotonic()) > 0:
                try:
                    time.sleep(min(left, 0.1))
                except LeaseLost:
                    interrupted += 1
        finally:
            signal.signal(signal.SIGTERM, previous)
        return {"attempt": ctx.attempt if ctx else 1, "interrupted": interrupted}
