"""Coroutine task bodies: ``@app.task async def fetch(url): ...`` on every pool.

Celery calls a task's function and, for an ``async def``, gets a coroutine back (and does nothing
with it). :func:`call_body` runs it to completion instead, on an event loop the worker keeps:

- **One loop per thread, kept.** A prefork or solo pool runs every body of its process on the main
  thread's loop; the threads pool one loop per pool thread. The loop is made on first use and
  reused (:func:`body_loop`): ``asyncio.run`` per call would make and close a loop (an epoll
  instance, a self-pipe, a default executor) every time, and would break a client a body keeps
  between calls (an ``aiohttp`` session, an ``asyncpg`` pool are bound to their loop). A forked
  child never uses a loop its parent made: it makes its own (the parent's is kept unclosed, as
  closing it would unregister the parent's self-pipe from the epoll instance they share).
- **Like ``asyncio.run`` otherwise.** The body runs as an asyncio task in a copy of the caller's
  context (``current_context()`` works inside it); the tasks it started and left running are
  cancelled when it returns.
- **Stopped by cancellation.** What would interrupt a sync body cancels the coroutine's asyncio
  task, so its ``except asyncio.CancelledError`` / ``finally`` run; the call then raises what
  stopped it:

  * a soft time limit: ``SoftTimeLimitExceeded`` (a prefork pool's SIGUSR1; in the threads and
    solo pools, which enforce no time limits, a timer on the loop does it: the soft limit, and
    the hard limit as ``TimeLimitExceeded``, both cooperative since a thread cannot be killed);
  * a lost lease, a cancelled run, a refused delayed claim: ``LeaseLost`` (the heartbeat thread
    calls :meth:`_Body.interrupt` through ``heartbeat.interrupted_by``);
  * a terminate signal (a revoke with ``terminate=True``, a cold shutdown): billiard's
    ``SystemExit``, once the coroutine's clean-up ran; a second one acts at once.

  A stronger cause replaces a weaker one (a soft limit, then a hard limit or a lost lease, then
  a process exit), cancelling again a body that caught its soft limit's cancel.

  A signal whose Python handler raises is routed this way while the loop runs on the main
  thread: an exception raised inside the loop's own code would be logged and swallowed. (The
  handler is wrapped once and the wrapper left in place, calling it alone outside a body; its
  ``__wrapped__`` is the handler.) A body
  that catches the ``CancelledError`` of a soft limit and returns keeps its result, as a sync body
  may catch ``SoftTimeLimitExceeded``; any other cause is raised whatever the body does.

The same task called outside an orchestrated run (``task.delay()`` on a plain worker,
``task.apply()``, ``task(...)``) runs its coroutine the same way; a direct call made where a
loop is already running in the thread returns the coroutine for the caller to ``await``.

gevent and eventlet pools are refused for coroutine bodies (a ``RuntimeError`` naming the pool
types that run them): their greenlets share one OS thread, where one event loop runs at a time, and
the loop would block the hub.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from .heartbeat import interrupted_by

log = logging.getLogger(__name__)

#: the signals whose Python handler may raise into a body on the main thread: the prefork pool's
#: soft time limit (SIGUSR1), the heartbeat's fence (SIGUSR2), terminate and interrupt signals
_ROUTED = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGQUIT")) if s
)
#: seconds the tasks a body left running get to finish once cancelled
_GRACE = 5.0
#: a process-exit cause: raised at once when a second one comes during a clean-up
_EXITS = (SystemExit, KeyboardInterrupt)

_local = threading.local()
#: loops a forked child inherited: kept referenced, never closed (see the module's docstring)
_inherited: list[asyncio.AbstractEventLoop] = []


def body_loop() -> asyncio.AbstractEventLoop:
    """The calling thread's loop for coroutine bodies, made on first use and kept (one per
    thread and process)."""
    held: tuple[int, asyncio.AbstractEventLoop] | None = getattr(_local, "held", None)
    pid = os.getpid()
    if held is not None and held[0] == pid and not held[1].is_closed():
        return held[1]
    if held is not None and held[0] != pid:
        _inherited.append(held[1])
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the thread's loop for sync code too (asyncio.get_event_loop())
    _local.held = (pid, loop)
    return loop


def call_body(task: Any, args: Any, kwargs: Any) -> Any:
    """Call a task's body (``task.run``) the way a worker runs it: a coroutine it returns runs
    to completion on :func:`body_loop` within the request's time limits (see the module)."""
    result = task.run(*args, **kwargs)
    if not inspect.iscoroutine(result):
        return result
    soft, hard = time_limits(task)
    return run_coroutine(result, soft=soft, hard=hard)


def call_direct(result: Any) -> Any:
    """What a direct call (``task(...)``) returns: a coroutine's result, run to completion on
    :func:`body_loop`; the coroutine itself when a loop already runs in this thread (to await)."""
    if not inspect.iscoroutine(result) or _loop_running():
        return result
    return run_coroutine(result)


def time_limits(task: Any) -> tuple[float | None, float | None]:
    """(soft, hard) seconds of the running request: its message's ``timelimit``, else the task's
    own limits, else the app's defaults (what Celery's worker gives the prefork pool)."""
    hard, soft = getattr(task.request, "timelimit", None) or (None, None)
    conf = task.app.conf
    soft = soft or task.soft_time_limit or conf.task_soft_time_limit
    hard = hard or task.time_limit or conf.task_time_limit
    return (float(soft) if soft else None), (float(hard) if hard else None)


class _Body:
    """One coroutine body on its loop, and what stopped it (``cause``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self.cause: BaseException | None = None
        #: where the coroutine was when it was cancelled (the cause is raised from there)
        self.where: Any = None

    def interrupt(self, cause: BaseException) -> bool:
        """Stop the body because of ``cause`` (from any thread, or a signal handler); ``False``
        when a cause at least as strong already stands. The strength: a soft time limit, then a
        hard one, a lost lease or anything else, then a process exit. A stronger cause replaces
        the one standing; it cancels the body again only after a soft limit (which the body may
        have caught), a clean-up under way is left to finish."""
        standing = self.cause
        if standing is not None and _strength(cause) <= _strength(standing):
            return False
        self.cause = cause
        if standing is None or isinstance(standing, SoftTimeLimitExceeded):
            try:
                self.loop.call_soon_threadsafe(self._cancel)
            except RuntimeError:  # the loop is closed: nothing runs on it any more
                pass
        return True

    def _cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel(f"{type(self.cause).__name__}")

    async def guard(self, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coro
        except BaseException as exc:
            # the body's frames: the task's machinery loses them when it raises the exception again
            self.where = exc.__traceback__
            raise

    def outcome(self) -> Any:
        """The body's result, or what stopped it (or what it raised) raised from where the
        coroutine was."""
        task, cause = self.task, self.cause
        assert task is not None
        if cause is not None and (task.cancelled() or not isinstance(cause, SoftTimeLimitExceeded)):
            raise cause.with_traceback(self.where or cause.__traceback__)
        if task.cancelled():
            raise asyncio.CancelledError().with_traceback(self.where)
        exc = task.exception()
        if exc is not None:
            raise exc.with_traceback(self.where or exc.__traceback__)
        return task.result()


def run_coroutine(coro: Coroutine[Any, Any, Any], *, soft: float | None = None, hard: float | None = None) -> Any:
    """Run ``coro`` to completion on this thread's loop; ``soft``/``hard``: time limits the
    coroutine is held to where no prefork pool enforces them (see the module)."""
    if _loop_running():
        coro.close()
        raise RuntimeError("a coroutine task body cannot run where an event loop is already running in the thread")
    greenlets = _greenlet_pool()
    if greenlets is not None:
        coro.close()
        raise RuntimeError(
            f"a coroutine task body cannot run under {greenlets} (its greenlets share one thread, where one event"
            " loop runs at a time): run the worker with the prefork, threads or solo pool"
        )
    loop = body_loop()
    body = _Body(loop)
    body.task = loop.create_task(body.guard(coro))
    timers = [] if _pool_enforces_limits() else _timers(loop, body, soft, hard)
    restore = _route_signals(body)
    try:
        with interrupted_by(body.interrupt):
            try:
                loop.run_until_complete(body.task)
            except BaseException:
                if not body.task.done():
                    # out of the loop before the body ended (a second terminate signal): no
                    # clean-up, what is left is cancelled and runs down when the loop runs again
                    for t in asyncio.all_tasks(loop):
                        t.cancel()
                    raise
                # else the body raised: its outcome says it
            finally:
                for timer in timers:
                    timer.cancel()
            _sweep(loop)
    finally:
        restore()
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()  # cancelled before it started: never awaited, and not to be warned about
    return body.outcome()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _greenlet_pool() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when that library has patched the threads of this process."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return "gevent"
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        return "eventlet"
    return None


def _pool_enforces_limits() -> bool:
    """Whether the prefork pool enforces the time limits here (its SIGUSR1 raises the soft one)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        from billiard.pool import soft_timeout_sighandler
    except ImportError:  # pragma: no cover - billiard comes with Celery
        return False
    handler = signal.getsignal(signal.SIGUSR1)
    return getattr(handler, "__wrapped__", handler) is soft_timeout_sighandler  # routed or not


def _timers(
    loop: asyncio.AbstractEventLoop, body: _Body, soft: float | None, hard: float | None
) -> list[asyncio.TimerHandle]:
    """The time limits as timers on the loop (pools that enforce none: threads, solo)."""
    timers = []
    if soft:
        timers.append(loop.call_later(soft, body.interrupt, SoftTimeLimitExceeded(soft)))
    if hard and (not soft or hard > soft):
        # a body that outlived its soft limit's cancel is cancelled again
        timers.append(loop.call_later(hard, body.interrupt, TimeLimitExceeded(hard)))
    return timers


def _strength(cause: BaseException) -> int:
    if isinstance(cause, _EXITS):
        return 3
    return 1 if isinstance(cause, SoftTimeLimitExceeded) else 2


#: the coroutine body the main thread runs now, where the signal routers send what a handler raises
_main_body: _Body | None = None


def _route_signals(body: _Body) -> Callable[[], None]:
    """On the main thread, route what the signal handlers raise to ``body.interrupt`` while the
    loop runs; returns what ends it. A handler is wrapped once in a router that is left in place
    (installing and restoring the handlers of a prefork pool process around every body would
    cost more than the loop saves); outside a body the router only calls the handler it wraps.
    A handler installed since, or one that replaced itself (billiard's terminate handler sets
    its signal back to the default), is wrapped anew at the next body."""
    global _main_body
    if threading.current_thread() is not threading.main_thread():
        return _nothing
    for signum in _ROUTED:
        handler = signal.getsignal(signum)
        if callable(handler) and not hasattr(handler, "routed_by_aio"):
            signal.signal(signum, _router(handler))
    _main_body = body
    return _end_routing


def _end_routing() -> None:
    global _main_body
    _main_body = None


def _router(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    def route(signum: int, frame: Any) -> Any:
        body = _main_body
        if body is None:
            return handler(signum, frame)
        try:
            return handler(signum, frame)
        except BaseException as exc:
            if not body.interrupt(exc) and isinstance(exc, _EXITS):
                raise  # a second terminate or interrupt: no more clean-up
        return None

    route.__wrapped__ = handler  # type: ignore[attr-defined]
    route.routed_by_aio = True  # type: ignore[attr-defined]
    return route


def _nothing() -> None:
    return None


def _sweep(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks a body started and left running (as ``asyncio.run`` does), and give them
    :data:`_GRACE` seconds to finish."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not left:
        return
    for t in left:
        t.cancel()
    try:
        _, pending = loop.run_until_complete(asyncio.wait(left, timeout=_GRACE))
    except BaseException:
        log.exception("cancelling what a coroutine body left running failed")
        return
    if pending:
        log.warning("%d task(s) a coroutine body left running ignored their cancellation", len(pending))
