"""Coroutine task bodies (``orchestrator/runtime/aio.py``) in process: one loop per thread, kept and
reused (a forked child makes its own); the body in the caller's context; what it leaves running
cancelled; stopped by a soft or hard time limit (a timer where no prefork pool enforces them, the
prefork pool's SIGUSR1 on the main thread), by a lost lease (the heartbeat's interrupt) and by a
terminate signal, each time after its ``except asyncio.CancelledError`` ran; plain Celery calls
(``task(...)``, ``task.apply()``) run the coroutine; the registry sees an async ``upstream``."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from billiard.common import _shutdown_cleanup, clear_terminate_handler_fired
from billiard.pool import soft_timeout_sighandler
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from orchestrator.core.registry import CeleryRegistry, declares_upstream
from orchestrator.runtime import aio
from orchestrator.runtime.heartbeat import LeaseLost, _interrupt
from tasks import aio as aio_tasks

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (not the main one): its result, or what it raised."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return out[0]


class Forever:
    """A coroutine that awaits forever and notes how it ended."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    async def __call__(self) -> None:
        self.notes.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            self.notes.append(f"cancelled {' '.join(map(str, exc.args))}")
            raise
        finally:
            self.notes.append("finally")


@pytest.fixture
def restored_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in aio._ROUTED}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


# ------------------------------------------------------------------ the loop: one per thread, kept


def test_a_thread_keeps_its_loop_across_bodies() -> None:
    assert aio.run_coroutine(double(2)) == 4
    loop = aio.body_loop()
    assert aio.run_coroutine(double(3)) == 6
    assert aio.body_loop() is loop and not loop.is_closed() and not loop.is_running()


def test_each_thread_has_its_own_loop_kept_across_its_bodies() -> None:
    mine = aio.body_loop()

    def twice() -> tuple[int, int]:
        first = aio.body_loop()
        aio.run_coroutine(double(1))
        aio.run_coroutine(double(1))
        return id(first), id(aio.body_loop())

    a, b = in_thread(twice)
    assert a == b != id(mine)


def test_a_forked_child_makes_its_own_loop_and_leaves_the_parents_open(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = aio.body_loop()
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 100_000)
    child = aio.body_loop()
    assert child is not parent
    assert aio.run_coroutine(double(5)) == 10
    assert aio.body_loop() is child
    assert parent in aio._inherited and not parent.is_closed()  # its epoll is the parent's too


# ------------------------------------------------------------------ like asyncio.run otherwise


def test_the_body_runs_in_the_callers_context_and_its_leftovers_are_cancelled() -> None:
    left: list[str] = []

    async def background() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            left.append("cancelled")
            raise

    async def body() -> str:
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0)
        return VAR.get()

    token = VAR.set("the caller's")
    try:
        assert aio.run_coroutine(body()) == "the caller's"
    finally:
        VAR.reset(token)
    assert left == ["cancelled"]
    assert not [t for t in asyncio.all_tasks(aio.body_loop()) if not t.done()]


def test_a_body_that_raises_raises_from_its_own_frame() -> None:
    async def body() -> None:
        await asyncio.sleep(0)
        raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        aio.run_coroutine(body())
    assert info.traceback[-1].name == "body"


def test_a_direct_call_inside_a_running_loop_returns_the_coroutine_to_await() -> None:
    async def outer() -> int:
        got = aio.call_direct(double(4))
        assert asyncio.iscoroutine(got)
        return int(await got)

    assert asyncio.run(outer()) == 8
    with pytest.raises(RuntimeError, match="already running"):
        asyncio.run(_run_inside())


async def _run_inside() -> None:
    aio.run_coroutine(double(1))


@pytest.mark.parametrize(
    "module, check", [("gevent.monkey", "is_module_patched"), ("eventlet.patcher", "is_monkey_patched")]
)
def test_a_greenlet_pool_is_refused_with_the_pools_that_run_coroutines(
    monkeypatch: pytest.MonkeyPatch, module: str, check: str
) -> None:
    monkeypatch.setitem(sys.modules, module, SimpleNamespace(**{check: lambda name: True}))
    coro = double(1)
    with pytest.raises(RuntimeError, match=r"cannot run under (gevent|eventlet).*prefork, threads or solo pool"):
        aio.run_coroutine(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # never "was never awaited"


# ------------------------------------------------------------------ what stops a body


def test_a_soft_time_limit_cancels_the_body_where_no_pool_enforces_it() -> None:
    body = Forever()
    began = time.monotonic()
    got = in_thread(lambda: aio.run_coroutine(body(), soft=0.2, hard=30))
    assert isinstance(got, SoftTimeLimitExceeded), got
    assert time.monotonic() - began >= 0.2  # not before its limit (the upper bound is the machine's)
    assert body.notes == ["started", "cancelled SoftTimeLimitExceeded", "finally"]


def test_a_body_that_outlives_its_soft_limit_is_stopped_at_the_hard_one() -> None:
    notes: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            notes.append("soft")
        try:
            await asyncio.sleep(60)  # a clean-up that takes too long
        except asyncio.CancelledError:
            notes.append("hard")
            raise

    got = in_thread(lambda: aio.run_coroutine(stubborn(), soft=0.1, hard=0.3))
    assert isinstance(got, TimeLimitExceeded), got
    assert notes == ["soft", "hard"]


def test_a_body_that_catches_its_soft_limit_keeps_its_result() -> None:
    async def careful() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "partial"
        return "all"

    assert in_thread(lambda: aio.run_coroutine(careful(), soft=0.1)) == "partial"


def test_a_lost_lease_cancels_the_body_and_raises_lease_lost() -> None:
    body = Forever()

    def run() -> Any:
        me = threading.get_ident()
        threading.Timer(0.2, _interrupt, (me,)).start()  # what the heartbeat thread does
        return aio.run_coroutine(body())

    got = in_thread(run)
    assert isinstance(got, LeaseLost), got
    assert body.notes == ["started", "cancelled LeaseLost", "finally"]


def test_prefork_soft_limit_signal_cancels_the_body_on_the_main_thread(restored_signals: None) -> None:
    signal.signal(signal.SIGUSR1, soft_timeout_sighandler)  # as billiard's pool process has it
    assert aio._pool_enforces_limits()
    body = Forever()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    with pytest.raises(SoftTimeLimitExceeded) as info:
        aio.run_coroutine(body(), soft=0.01)  # the pool's signal decides, not a timer
    assert body.notes == ["started", "cancelled SoftTimeLimitExceeded", "finally"]
    # raised from where the coroutine was (a poison fingerprint tells one place from another)
    assert any(entry.name == "__call__" for entry in info.traceback)
    # the handler stays wrapped, and outside a body the wrapper is the handler alone
    router = signal.getsignal(signal.SIGUSR1)
    assert router.__wrapped__ is soft_timeout_sighandler  # type: ignore[union-attr]
    with pytest.raises(SoftTimeLimitExceeded):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)  # the handler raises in this frame first
    aio.run_coroutine(double(1))
    assert signal.getsignal(signal.SIGUSR1) is router  # wrapped once
    assert aio._pool_enforces_limits()  # seen through its router


def test_the_fence_signal_is_still_the_heartbeats_through_its_router(restored_signals: None) -> None:
    from orchestrator.runtime import heartbeat

    assert heartbeat._prepare_fencing()
    aio.run_coroutine(double(1))  # wraps it
    assert signal.getsignal(heartbeat._FENCE_SIGNAL) is not heartbeat._on_fence_signal
    assert heartbeat._fence_handler() is heartbeat._on_fence_signal
    router = signal.getsignal(heartbeat._FENCE_SIGNAL)
    heartbeat._prepare_fencing()  # the next attempt's track(): the router stays
    assert signal.getsignal(heartbeat._FENCE_SIGNAL) is router
    # a sync body on the main thread is still fenced by the signal, through the router
    with pytest.raises(LeaseLost):
        _interrupt(threading.main_thread().ident or 0)
        time.sleep(5)


def test_a_terminate_signal_cancels_the_body_then_exits(restored_signals: None) -> None:
    signal.signal(signal.SIGTERM, _shutdown_cleanup)  # billiard's, in a pool process
    body = Forever()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        with pytest.raises(SystemExit) as info:
            aio.run_coroutine(body())
    finally:
        clear_terminate_handler_fired()
    assert info.value.code == signal.SIGTERM - 256
    assert body.notes == ["started", "cancelled SystemExit", "finally"]
    # billiard's handler set SIGTERM back to its default: a second one is not caught again
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_terminate_signal_cancels_again_a_body_that_caught_its_soft_limit(restored_signals: None) -> None:
    signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    signal.signal(signal.SIGTERM, _shutdown_cleanup)
    notes: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError as exc:
            notes.append(f"ignored {exc.args[0]}")
            os.kill(os.getpid(), signal.SIGTERM)  # the pool kills it at its hard limit
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError as exc:
            notes.append(f"cancelled {exc.args[0]}")
            raise

    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    try:
        with pytest.raises(SystemExit):
            aio.run_coroutine(stubborn())
    finally:
        clear_terminate_handler_fired()
    assert notes == ["ignored SoftTimeLimitExceeded", "cancelled SystemExit"]


def test_a_second_interrupt_signal_stops_a_clean_up_at_once(restored_signals: None) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a script's Ctrl-C, as asyncio.run takes it
    notes: list[str] = []

    async def slow_clean_up() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            notes.append("clean-up")
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()  # impatient: a second Ctrl-C
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                notes.append("clean-up cancelled")
                raise

    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        aio.run_coroutine(slow_clean_up())
    assert notes == ["clean-up"]
    # what was left is cancelled and runs down with the next body on the loop
    assert aio.run_coroutine(double(2)) == 4
    assert notes == ["clean-up", "clean-up cancelled"]
    assert not [t for t in asyncio.all_tasks(aio.body_loop()) if not t.done()]


# ------------------------------------------------------------------ a task's plain Celery calls


def test_an_async_task_called_directly_or_applied_returns_its_result() -> None:
    assert aio_tasks.number(7) == 7
    assert aio_tasks.number.apply(args=(8,)).get() == 8
    total = aio_tasks.add_up({"a": 1, "b": 2}, plus=3)
    assert total["total"] == 6 and total["attempt"] is None


def test_the_registry_sees_an_async_tasks_upstream_parameter() -> None:
    assert declares_upstream(aio_tasks.add_up)
    assert not declares_upstream(aio_tasks.number)
    registry = CeleryRegistry(aio_tasks.app)
    assert registry.is_registered("tasks.aio.add_up")
    assert registry.wants_upstream("tasks.aio.add_up")


def test_time_limits_read_from_the_request_then_the_task_then_the_app() -> None:
    task = aio_tasks.number
    task.push_request(timelimit=(20, 10))
    try:
        assert aio.time_limits(task) == (10.0, 20.0)
    finally:
        task.pop_request()
    task.push_request(timelimit=None)
    try:
        soft, hard = aio.time_limits(task)
        assert soft is None and hard == float(task.app.conf.task_time_limit)
    finally:
        task.pop_request()
