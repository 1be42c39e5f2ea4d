"""Self-fencing: one heartbeat thread per worker process extends the leases of the attempts it runs,
claims the direct bodies that outlive the claim delay, and interrupts a body whose attempt lost its
task (:class:`LeaseLost`: a signal on the main thread, an asynchronous exception elsewhere; a
coroutine body's asyncio task is cancelled instead, see :func:`interrupted_by`)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..core.protocol import (
    FencingToken,
)
from ..engine.facade import Orchestrator

log = logging.getLogger(__name__)


class LeaseLost(BaseException):
    """Raised inside a task body whose lease was taken from it: the worker fences itself.

    A BaseException, so that a body's ``except Exception`` does not swallow it."""


_FENCE_SIGNAL = signal.SIGUSR2

_fence_requested = threading.Event()


def _on_fence_signal(signum: int, frame: Any) -> None:
    if _fence_requested.is_set():
        _fence_requested.clear()
        raise LeaseLost()


def _fence_handler() -> Any:
    """The fence signal's handler, seen through the router a coroutine body wraps it in (its
    ``__wrapped__``, ``runtime/aio.py``)."""
    handler = signal.getsignal(_FENCE_SIGNAL)
    return getattr(handler, "__wrapped__", handler)


def _prepare_fencing() -> bool:
    """Install the fence signal handler when bodies run on the main thread (prefork, solo)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _fence_handler() is not _on_fence_signal:
        signal.signal(_FENCE_SIGNAL, _on_fence_signal)
    return True


#: thread id -> how to stop the coroutine body that thread runs (``runtime/aio.py``): its asyncio
#: task is cancelled on its loop, neither a signal nor an asynchronous exception (either could land
#: in the loop's own code, which logs and swallows what a callback raises)
_interrupters: dict[int, Callable[[BaseException], object]] = {}


@contextmanager
def interrupted_by(stop: Callable[[BaseException], object]) -> Iterator[None]:
    """While the block runs, a lease lost (or a delayed claim refused) for the calling thread's
    body calls ``stop(LeaseLost())`` (from the heartbeat thread) instead of interrupting the thread."""
    ident = threading.get_ident()
    _interrupters[ident] = stop
    try:
        yield
    finally:
        _interrupters.pop(ident, None)


def _interrupt(thread_id: int) -> None:
    """Raise :class:`LeaseLost` in the thread running the body.

    On the main thread (prefork and solo pools) a signal does it, which also breaks a
    blocking call such as ``time.sleep`` or a socket read; in other threads (the threads
    pool) an asynchronous exception does it, taking effect at the next bytecode. A thread
    running a coroutine body (:func:`interrupted_by`) has its asyncio task cancelled instead.
    """
    stop = _interrupters.get(thread_id)
    if stop is not None:
        stop(LeaseLost())
        return
    if thread_id == threading.main_thread().ident and _fence_handler() is _on_fence_signal:
        _fence_requested.set()
        signal.pthread_kill(thread_id, _FENCE_SIGNAL)
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(LeaseLost))


#: the longest the heartbeat thread sleeps at a time: a direct body's claim is at most this late
_CLAIM_POLL = 0.05


@dataclass
class _Unclaimed:
    """A direct message's body running before its claim (see :meth:`Heartbeater.track_direct`)."""

    thread_id: int
    #: seconds of the claim delay left
    left: float
    claim: Callable[[], bool]
    #: pending -> claiming -> held | refused | failed (the claim could not be written)
    state: str = "pending"
    #: the body returned or raised (its thread is in untrack(): not to be interrupted)
    finished: bool = False


class Heartbeater:
    """One daemon thread per process extending the leases of the attempts it runs, and claiming
    the direct bodies that outlive the claim delay.

    When an extension CAS fails, the attempt no longer holds the task: the body is
    interrupted with :class:`LeaseLost` and its outcome will be rejected (self-fencing). A
    direct body whose delayed claim is refused is interrupted the same way.
    """

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        self.lease = orchestrator.settings.lease_seconds
        self.claim_delay = orchestrator.settings.claim_delay
        self._active: dict[FencingToken, int] = {}
        self._unclaimed: dict[FencingToken, _Unclaimed] = {}
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="orc-heartbeat", daemon=True)
            self._thread.start()

    def track(self, token: FencingToken) -> None:
        """Start beating for an attempt run by the calling thread."""
        _prepare_fencing()
        with self._lock:
            self._active[token] = threading.get_ident()
            self._start()

    def track_direct(self, token: FencingToken, claim: Callable[[], bool]) -> None:
        """A direct body starts unclaimed in the calling thread: ``claim()`` (the claim; whether
        it was accepted) is made from this thread once the claim delay has passed, and the
        attempt is then tracked as any other."""
        _prepare_fencing()
        with self._lock:
            self._unclaimed[token] = _Unclaimed(threading.get_ident(), self.claim_delay, claim)
            self._start()

    def untrack(self, token: FencingToken) -> str:
        """Stop tracking the attempt once its body returned or raised: ``"unclaimed"`` (a direct
        body that finished before its claim: the caller claims, with its outcome), ``"held"``
        (claimed and still holding the task), ``"refused"`` (its delayed claim lost),
        ``"failed"`` (its delayed claim could not be written: the body was stopped unrecorded)
        or ``"lost"`` (its lease was taken over)."""
        with self._lock:
            entry = self._unclaimed.get(token)
            if entry is not None:
                entry.finished = True
            while entry is not None and entry.state == "claiming":
                self._lock.wait()
            if entry is not None:
                del self._unclaimed[token]
                if entry.state == "pending":
                    return "unclaimed"
                if entry.state in ("refused", "failed"):
                    return entry.state
            return "held" if self._active.pop(token, None) is not None else "lost"

    def _loop(self) -> None:
        # time is counted in the sleeps made, never read from a clock: a worker whose clock is
        # shifted or jumps (libfaketime moves the monotonic clock too) still beats and claims
        # on time, and a relative sleep never waits for an absolute deadline
        interval = max(self.lease / 3.0, 0.05)
        since_beat = 0.0
        while True:
            with self._lock:
                left = [e.left for e in self._unclaimed.values() if e.state == "pending"]
            # a direct body may start while this thread sleeps: with a claim delay, never sleep
            # longer than _CLAIM_POLL (without one, no body starts unclaimed)
            poll = [_CLAIM_POLL] if self.claim_delay > 0 else []
            step = max(min([*left, interval - since_beat, *poll]), 0.001)
            time.sleep(step)
            since_beat += step
            due: list[tuple[FencingToken, _Unclaimed]] = []
            with self._lock:
                for token, entry in self._unclaimed.items():
                    if entry.state == "pending":
                        entry.left -= step
                        if entry.left <= 0:
                            entry.state = "claiming"
                            due.append((token, entry))
            for token, entry in due:
                self._claim(token, entry)
            if since_beat >= interval:
                self._beat()
                since_beat = 0.0

    def _claim(self, token: FencingToken, entry: _Unclaimed) -> None:
        failed = False
        try:
            held = entry.claim()
        except Exception:
            log.exception("claim of %s failed; its body is stopped and its message requeued", token.task_id)
            held, failed = False, True
        with self._lock:
            # under the lock: untrack() waits while the claim is being made, then reads its outcome
            if held:
                entry.state = "held"
                self._active[token] = entry.thread_id
            else:
                entry.state = "failed" if failed else "refused"
                if not entry.finished:
                    log.info("claim of %s refused: stopping its body (a duplicate or stale message)", token.task_id)
                    _interrupt(entry.thread_id)
            self._lock.notify_all()

    def _beat(self) -> None:
        with self._lock:
            items = list(self._active.items())
        for token, thread_id in items:
            try:
                alive = self.orc.heartbeat(token)
            except Exception:
                log.exception("heartbeat failed for %s", token.task_id)
                continue
            if alive:
                continue
            with self._lock:
                # under the lock: untrack() cannot return between the check and the interrupt
                if self._active.pop(token, None) is None:
                    continue  # finished meanwhile
                log.warning("lease lost for %s: stopping the body", token.task_id)
                _interrupt(thread_id)


_heartbeaters: dict[int, Heartbeater] = {}


def _heartbeater(orc: Orchestrator) -> Heartbeater:
    hb = _heartbeaters.get(os.getpid())
    if hb is None:
        hb = _heartbeaters[os.getpid()] = Heartbeater(orc)
    return hb


def install_heartbeater(heartbeater: Heartbeater | None) -> Heartbeater | None:
    """Make ``heartbeater`` this process's (``None``: none, the next attempt makes one); returns the
    one it replaces. The test kit installs one over its own orchestrator for the runs it drives."""
    pid = os.getpid()
    previous = _heartbeaters.get(pid)
    if heartbeater is None:
        _heartbeaters.pop(pid, None)
    else:
        _heartbeaters[pid] = heartbeater
    return previous
