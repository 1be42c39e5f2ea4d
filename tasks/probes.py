"""Probe tasks: smoke-test a deployment; used by the tests and the benchmark.

``crash`` (kills its pool process) and ``hang`` (never returns) are registered only with
``ORCHESTRATOR_HAZARD_PROBES=1`` (the tests and the chaos soak set it).

Inside a DAG, the attempt number comes from the orchestrator; called as a plain Celery
task it is Celery's ``retries + 1``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from orchestrator import Defer
from orchestrator.celery_app import get_app
from orchestrator.runtime.process import current_orchestrator
from orchestrator.store.probes import record_effect
from orchestrator.worker import current_context

app = get_app()


def _attempt(task: Any) -> int:
    ctx = current_context()
    return ctx.attempt if ctx else int(task.request.retries or 0) + 1


def _effect() -> None:
    """Record this execution (run, key, attempt, pid) when ORCHESTRATOR_RECORD_PROBE_EFFECTS is on."""
    ctx = current_context()
    if ctx is None:
        return
    orc = current_orchestrator(app)
    if orc.settings.record_probe_effects:
        record_effect(orc.store.engine, ctx.run_id, ctx.key, ctx.attempt, os.getpid())


@app.task(bind=True)
def noop(self: Any) -> None:
    """Do nothing."""
    _effect()
    return None


@app.task(bind=True)
def sleep(self: Any, seconds: float = 1.0) -> float:
    """Sleep ``seconds`` and return them."""
    _effect()
    time.sleep(float(seconds))
    return float(seconds)


@app.task(bind=True)
def report(self: Any, steps: int = 3, gate: str = "", timeout: float = 120.0) -> int:
    """Report ``steps`` progress steps with Celery's ``update_state`` (``{"done", "total"}``), then
    wait until the file ``gate`` exists (at most ``timeout`` seconds) before reporting ``"last"``
    and returning ``steps``: a test reads the progress while the task still runs."""
    _effect()
    for done in range(1, steps + 1):
        self.update_state(state="PROGRESS", meta={"done": done, "total": steps})
    deadline = time.monotonic() + timeout
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    self.update_state(state="FINISHING", meta={"done": steps, "total": steps, "last": True})
    return steps


class FlakyError(RuntimeError):
    """Raised by :func:`flaky` on its odd early attempts."""


class FlakyTimeout(TimeoutError):
    """Raised by :func:`flaky` on its even early attempts."""


@app.task(bind=True)
def flaky(self: Any, fail_times: int = 1) -> int:
    """Fail while the attempt number is <= ``fail_times``, then return the attempt.

    Consecutive failures alternate between :class:`FlakyError` and :class:`FlakyTimeout`, so
    their fingerprints differ: a transient fault that retries, never poison.
    """
    _effect()
    attempt = _attempt(self)
    if attempt <= int(fail_times):
        error = FlakyError if attempt % 2 else FlakyTimeout
        raise error(f"flaky: attempt {attempt} of the first {fail_times} fails")
    return attempt


class ProbeFailure(RuntimeError):
    """Raised by :func:`fail`."""


@app.task(bind=True)
def poisoned(self: Any, until_attempt: int = 3) -> int:
    """Raise the same :class:`ProbeFailure` (one fingerprint: poison, so the task is parked in
    DEAD_LETTER) on every attempt before ``until_attempt``; from then on return the attempt,
    as if an operator fixed the cause before retrying."""
    _effect()
    attempt = _attempt(self)
    if attempt < int(until_attempt):
        raise ProbeFailure("poisoned: the same failure on every attempt")
    return attempt


@app.task(bind=True)
def fail(self: Any, message: str = "probe failure") -> None:
    """Always raise :class:`ProbeFailure` with ``message``."""
    _effect()
    raise ProbeFailure(message)


if app.orchestrator_settings.hazard_probes:
    # only where asked for (ORCHESTRATOR_HAZARD_PROBES=1: the tests and the chaos soak): a
    # production worker must not run a task that kills or blocks its pool processes on request

    @app.task(bind=True)
    def crash(self: Any) -> None:
        """Kill the process running it (SIGKILL): a pool child dies mid-task."""
        _effect()
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(bind=True)
    def hang(self: Any) -> None:
        """Never return (until a time limit stops it)."""
        _effect()
        while True:
            time.sleep(1.0)


@app.task(bind=True)
def echo(self: Any, upstream: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Return its keyword arguments and its parents' results."""
    _effect()
    return {"kwargs": kwargs, "upstream": upstream or {}}


@app.task(bind=True)
def whoami(self: Any) -> dict[str, Any]:
    """Return what the task knows about itself: run, key, attempt and the run's logical date."""
    _effect()
    ctx = current_context()
    if ctx is None:
        return {}
    when = ctx.logical_date
    return {"run_id": ctx.run_id, "key": ctx.key, "attempt": ctx.attempt, "logical_date": when and when.isoformat()}


@app.task(bind=True)
def deferring(
    self: Any,
    event: str = "go",
    match: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    seconds: float = 0.0,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Until it is resumed, raise :class:`orchestrator.Defer` for ``event`` (a payload
    containing ``match``) saving ``state`` (on attempt 1, after sleeping ``seconds``); called
    again after the wait, return what it was resumed with (``current_context().resumed``) and
    its attempt."""
    _effect()
    ctx = current_context()
    if ctx is None or ctx.resumed is None:
        if seconds and (ctx is None or ctx.attempt == 1):
            time.sleep(float(seconds))
        raise Defer(event=event, match=match, state=state, timeout=timeout)
    return {"resumed": ctx.resumed, "attempt": ctx.attempt}


@app.task(bind=True)
def not_yet(self: Any, times: int = 2) -> dict[str, Any] | None:
    """A sensor's check: ``None`` ("not yet") on its first ``times`` checks, then
    ``{"checks": n}`` (``n`` the "not yet" answers before it, from the sensor's saved state)."""
    _effect()
    ctx = current_context()
    saved = ((ctx.resumed or {}).get("state") or {}) if ctx is not None else {}
    checks = int(saved.get("checks", 0))
    return {"checks": checks} if checks >= int(times) else None


#: one Redis client per process for :func:`resource` (on the broker's Redis)
_resource_redis: dict[str, Any] = {}


@app.task(bind=True)
def resource(self: Any, name: str = "fake", seconds: float = 0.0) -> int:
    """A call to a fake external resource that fails on command, for circuit breakers: while the
    Redis key ``orchestrator:fake:<name>:down`` (on the broker's Redis) is set, it raises
    ``ConnectionError``; while ``orchestrator:fake:<name>:slow`` holds a number, each call takes
    that many seconds instead of ``seconds``; every call is appended to
    ``orchestrator:fake:<name>:calls`` as ``"<unix time> ok|down <run>/<key>#<attempt>"``.
    Returns the attempt."""
    import redis

    url = str(self.app.conf.broker_url)
    client = _resource_redis.get(url)
    if client is None:
        client = _resource_redis[url] = redis.Redis.from_url(url)
    down = bool(client.exists(f"orchestrator:fake:{name}:down"))
    ctx = current_context()
    who = f"{ctx.run_id}/{ctx.key}#{ctx.attempt}" if ctx else "-"
    client.rpush(f"orchestrator:fake:{name}:calls", f"{time.time():.6f} {'down' if down else 'ok'} {who}")
    slow = client.get(f"orchestrator:fake:{name}:slow")
    seconds = float(slow) if slow is not None else seconds
    if seconds:
        time.sleep(seconds)
    if down:
        raise ConnectionError(f"fake resource {name} is down")
    return _attempt(self)


#: :func:`txn_insert`'s table, in a schema of its own (the tests create it)
TXN_WRITES = "txn_probe.writes"


@app.task(bind=True)
def txn_insert(
    self: Any, gate: str = "", hold_attempts: int = 0, timeout: float = 60.0, item: Any = None
) -> dict[str, Any]:
    """A transactional node's probe (``dag.task(..., transactional=True)``): insert one row (run,
    key, attempt, pid) into ``txn_probe.writes`` on the attempt's transaction
    (``current_context().transaction``), record the execution (an effect, committed at once on a
    connection of its own), then, on attempts up to ``hold_attempts``, wait until the file
    ``gate`` exists (at most ``timeout`` seconds): a test acts while its write is uncommitted.
    ``item``: a map's item, returned with the attempt."""
    import sqlalchemy as sa

    ctx = current_context()
    if ctx is None or ctx.transaction is None:
        raise RuntimeError("txn_insert runs as a transactional node (dag.task(..., transactional=True))")
    ctx.transaction.execute(
        sa.text(f"INSERT INTO {TXN_WRITES} (run_id, key, attempt, pid) VALUES (:run, :key, :attempt, :pid)"),
        {"run": ctx.run_id, "key": ctx.key, "attempt": ctx.attempt, "pid": os.getpid()},
    )
    _effect()
    deadline = time.monotonic() + timeout
    while gate and ctx.attempt <= hold_attempts and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "item": item}
