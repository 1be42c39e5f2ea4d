"""The cost of running a coroutine task body: on the loop kept per thread
(:func:`orchestrator.runtime.aio.run_coroutine`) against ``asyncio.run`` per call (a new loop, its
epoll instance, self-pipe and default executor made and closed every time), on the main thread
(a solo pool process, then a prefork pool process with its handlers: the Python signal handlers
are routed around each body) and on another thread (a threads pool thread), with a sync call for
scale.

    python bench/aio_loop.py [--n 3000] [--rounds 5]

Prints microseconds per body (the median round) for an empty body and for one that awaits
``asyncio.sleep(0)`` once. Interleaved rounds; no database, broker or worker.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from billiard.common import _shutdown_cleanup
from billiard.pool import soft_timeout_sighandler

from orchestrator.runtime import aio
from orchestrator.runtime.heartbeat import _on_fence_signal


async def empty() -> None:
    return None


async def one_turn() -> None:
    await asyncio.sleep(0)


def sync_body() -> None:
    return None


def per_call(run: Callable[[], Any], n: int) -> float:
    began = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - began) / n * 1e6


def measure(n: int, rounds: int) -> dict[str, list[float]]:
    ways: dict[str, Callable[[], Any]] = {
        "sync call": sync_body,
        "kept loop, empty": lambda: aio.run_coroutine(empty()),
        "asyncio.run, empty": lambda: asyncio.run(empty()),
        "kept loop, one await": lambda: aio.run_coroutine(one_turn()),
        "asyncio.run, one await": lambda: asyncio.run(one_turn()),
    }
    got: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            got[name].append(per_call(run, n))
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    aio.run_coroutine(empty())
    results = {"main thread": measure(args.n, args.rounds)}
    saved = {s: signal.getsignal(s) for s in aio._ROUTED}
    signal.signal(signal.SIGUSR1, soft_timeout_sighandler)  # what a prefork pool process has
    signal.signal(signal.SIGUSR2, _on_fence_signal)
    signal.signal(signal.SIGTERM, _shutdown_cleanup)
    signal.signal(signal.SIGQUIT, _shutdown_cleanup)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results["main thread, a prefork pool process's handlers"] = measure(args.n, args.rounds)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    other: dict[str, list[float]] = {}

    def in_thread() -> None:
        other.update(measure(args.n, args.rounds))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    results["another thread"] = other
    for where, got in results.items():
        print(f"{where} (us per body, median of {args.rounds} rounds of {args.n}):")
        for name, values in got.items():
            print(f"  {name:<24} {statistics.median(values):8.1f}")
        for body in ("empty", "one await"):
            kept, fresh = (statistics.median(got[f"{w}, {body}"]) for w in ("kept loop", "asyncio.run"))
            print(f"  asyncio.run / kept loop ({body}): {fresh / kept:.1f}x")


if __name__ == "__main__":
    main()
