"""One tenant slowing another's emit (issue 36, crossing 4), measured on a real Postgres.

Run from the repository root::

    python bench/event_tenants.py [--waits 5] [--events 20] [--items 10000] [--match-items 10000]
                                  [--hold 3] [--json]

Tenant ``acme`` first emits ``--events`` events of its key ``a.big``, each a payload of
``--items`` integers (``{"ids": [0, 1, ...]}``: about 59 KB for 10,000), then submits a run of
``--waits`` wait nodes on that key whose ``match`` holds ``--match-items`` of those integers and
one that no event has (so that each wait's lookback checks every event, the containment scanning
the payload's array once per element of the match), then emits 3 more such events (each checked
against the waits' matches). A release that refuses such a match at submit (the match bounds)
gets the largest one it accepts instead, and says so. Meanwhile tenant ``bravo`` emits its own key
every 50 ms from another thread. Then ``acme`` holds its key's event lock for ``--hold`` seconds
(a transaction that is slow on that key: a submit beginning many waits, a slow match) while
``bravo`` emits again.

``bravo``'s key is chosen in the same lock bucket as ``acme``'s under the shared scheme (the
releases before 0021: 256 buckets over every tenant's keys, ``hash(tenant/key) & 255``); the
releases since give each tenant its own buckets. Printed: ``bravo``'s emit latency alone
(before anything of ``acme``), during ``acme``'s submit and emits, and during the held lock;
``acme``'s submit and emit times.

The bench database (the name must contain "bench") is dropped and re-created at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench import reset_database  # noqa: E402

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_tenants"
A, B = "acme", "bravo"
A_KEY = "a.big"


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1),
        "max_ms": round(ms[-1], 1),
    }


class Emitter(threading.Thread):
    """Tenant B's emits, one every ``every`` seconds, each one's (start, latency) kept."""

    def __init__(self, orc: Any, key: str, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.orc, self.key, self.every = orc, key, every
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.n = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.n += 1
            began = time.monotonic()
            self.orc.events.emit(self.key, {"n": self.n}, event_id=f"b-{self.n}", tenant=B)
            self.samples.append((began, time.monotonic() - began))
            self.stop.wait(self.every)

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the emits that began in [start, end) or were in flight at start."""
        return [lat for began, lat in self.samples if began < end and began + lat >= start]


def shared_bucket_key(conn: Any) -> str:
    """A key of tenant B in the same bucket as A's key under the shared scheme."""
    import sqlalchemy as sa

    bucket = sa.text("SELECT (hashtextextended(:t || '/' || :k, 0) & 255)::int")
    target = conn.execute(bucket, {"t": A, "k": A_KEY}).scalar_one()
    for i in range(100_000):
        key = f"b.evt.{i}"
        if conn.execute(bucket, {"t": B, "k": key}).scalar_one() == target:
            return key
    raise SystemExit("no key of the same bucket found")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DB))
    parser.add_argument("--waits", type=int, default=5)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--items", type=int, default=10_000, help="integers in each of A's payloads")
    parser.add_argument("--match-items", type=int, default=10_000, help="elements of each wait's match array")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds A holds its key's event lock")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import sqlalchemy as sa

    from orchestrator import DAG, Orchestrator, Settings, ValidationError
    from orchestrator.core.publisher import RecordingPublisher
    from orchestrator.core.registry import StaticRegistry
    from orchestrator.core.routing import default_queues
    from orchestrator.store import Store

    reset_database(args.database_url)
    store = Store(args.database_url)
    store.workers.register("w", default_queues(), 100)
    orc = Orchestrator(
        Settings(database_url=args.database_url), store=store, publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )  # fmt: skip
    with store.engine.connect() as conn:
        b_key = shared_bucket_key(conn)
    out: dict[str, Any] = {"b_key": b_key, "args": vars(args) | {"database_url": "(bench)"}}

    payload = {"ids": list(range(args.items))}
    out["payload_bytes"] = len(json.dumps(payload))
    for i in range(args.events):
        orc.events.emit(A_KEY, payload, event_id=f"a-{i}", tenant=A)
    b_wait = DAG("b-waits")  # a wait of B on its key that none of its emits matches
    b_wait.wait("w", event=b_key, match={"never": True})
    orc.submit(b_wait, tenant=B)

    emitter = Emitter(orc, b_key)
    emitter.start()
    time.sleep(2.0)
    alone_end = time.monotonic()

    def a_dag(items: int) -> DAG:
        # all present but the last (absent: no event matches, every lookback checks every event)
        match = {"ids": [*range(args.items - items + 1, args.items), -1]}
        dag = DAG("a-waits")
        for w in range(args.waits):
            dag.wait(f"w{w}", event=A_KEY, match=match)
        dag.task("after", "t", upstream=[f"w{w}" for w in range(args.waits)])
        return dag

    items = args.match_items
    try:
        dag = a_dag(items)
    except ValidationError as exc:
        out["refused"] = str(exc)
        from orchestrator.core.waits import MAX_MATCH_ITEMS

        items = MAX_MATCH_ITEMS
        dag = a_dag(items)
    out["match_items_used"] = items
    a_start = time.monotonic()
    orc.submit(dag, tenant=A)
    out["a_submit_s"] = round(time.monotonic() - a_start, 3)
    emit_start = time.monotonic()
    for i in range(3):
        orc.events.emit(A_KEY, payload, event_id=f"a-late-{i}", tenant=A)
    out["a_emit_s"] = round((time.monotonic() - emit_start) / 3, 3)
    a_end = time.monotonic()

    time.sleep(0.5)
    hold_start = time.monotonic()
    with store.engine.connect() as conn, conn.begin():
        conn.execute(sa.text("SELECT orc_event_lock_v1(:t, :k)"), {"t": A, "k": A_KEY})
        time.sleep(args.hold)
    hold_end = time.monotonic()
    time.sleep(0.5)
    emitter.stop.set()
    emitter.join(120)
    store.dispose()

    out["b_alone"] = summary(emitter.between(0, alone_end))
    out["b_during_a"] = summary(emitter.between(a_start, a_end))
    out["b_during_hold"] = summary(emitter.between(hold_start, hold_end))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"A: {args.events} events of {out['payload_bytes']} bytes; {args.waits} waits, match of {items} items")
    if "refused" in out:
        print(f"   ({args.match_items} refused at DAG.wait: {out['refused']})")
    print(f"A: submit {out['a_submit_s']} s, emit {out['a_emit_s']} s each")
    for name in ("b_alone", "b_during_a", "b_during_hold"):
        print(f"B emit latency {name[2:]:>12}: {out[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
