"""The sharded reconciler (issue 35) with 1, 2, 4 and 8 instances: release throughput, failover
after kill -9 of an owner, stale-epoch refusals, sessions per instance.

Each instance is a real ``python -m orchestrator.cli reconcile`` process in the sharded mode
(``ORCHESTRATOR_RECONCILER_SHARDS``), named by its ``application_name`` so its server sessions can
be counted. No Celery worker runs: the work measured is the reconciler's own (due retries
released, RETRYING -> READY, each a compare-and-set with its ledger row); the tasks are put
RETRYING by an UPDATE (a bench's shortcut: their failures are not in the ledger).

- actions/s: ``--tasks`` retries all due at once, the time from "due" until every one is READY
  (the database's clock: the ledger rows' ``at``), per instance count;
- failover: with N >= 2 instances, one owner killed -9, retries due at once in its shards: the
  time from the kill until the last of them is released, ``--trials`` times, p50/p99 against the
  lease; the other shards' retries are released meanwhile;
- applied twice: accepted RETRYING -> READY rows per (run, key, attempt) above one (must be 0);
  stale-epoch refusals: rejected rows whose reason names a stale shard epoch;
- sessions: ``pg_stat_activity`` rows per instance (peak seen while it works).

    python bench/shards.py --tasks 2000 --trials 5 --lease 2

The machine has 2 cores, shared: the times depend on its load; the counts do not.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator import DAG  # noqa: E402
from orchestrator.core.routing import route  # noqa: E402
from orchestrator.store import Store, make_engine, migrate  # noqa: E402
from orchestrator.store.shards import shard_of  # noqa: E402

BASE = os.environ.get("BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
DB = "orchestrator_bench_shards"
K = 64


def database() -> str:
    admin = sa.create_engine(BASE + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if not conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": DB}).first():
            conn.execute(sa.text(f'CREATE DATABASE "{DB}"'))
    admin.dispose()
    url = f"{BASE}/{DB}"
    engine = make_engine(url)
    migrate.reset(engine)
    engine.dispose()
    return url


def submit_runs(store: Store, n: int) -> list[str]:
    dag = DAG("bench-shards")
    dag.task("a", "t", max_attempts=5)
    queues = {k: route(dag.tenant, dag.priority_of(node), node.queue) for k, node in dag.nodes.items()}
    return [store.submission.create_run(dag, queues=queues, wants_upstream=lambda name: True)[0] for _ in range(n)]


def make_due(store: Store, run_ids: list[str]) -> Any:
    """The runs' tasks RETRYING, due now; returns the database's 'now'."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE orc_tasks SET state = 'RETRYING', attempt = attempt + 1, not_before = now()"
                " WHERE run_id = ANY(:ids) AND state IN ('READY', 'PENDING')"
            ),
            {"ids": run_ids},
        )
        return conn.execute(sa.text("SELECT now()")).scalar_one()


def released(store: Store, run_ids: list[str]) -> tuple[int, Any]:
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE state = 'READY'), max(ready_at) FROM orc_tasks WHERE run_id = ANY(:ids)"
            ),
            {"ids": run_ids},
        ).one()
    return int(row[0]), row[1]


def start(url: str, indices: range | list[int], lease: float, tick: float) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in indices:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        env.update(
            ORCHESTRATOR_DATABASE_URL=f"{url}?application_name=bench-shards-{i}",
            ORCHESTRATOR_BROKER_URL="memory://",
            ORCHESTRATOR_RECONCILER_SHARDS=str(K),
            ORCHESTRATOR_RECONCILER_SHARD_LEASE=str(lease),
            ORCHESTRATOR_TICK_SECONDS=str(tick),
            ORCHESTRATOR_DATA_DIR=f"/tmp/bench-shards-{os.getpid()}",
        )
        cmd = [sys.executable, "-m", "orchestrator.cli", "reconcile", "--name", f"bench-{i}"]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        )  # fmt: skip
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def owners(store: Store) -> dict[int, str | None]:
    with store.engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT shard, owner FROM orc_shards")).all())  # type: ignore[arg-type]


def sessions(store: Store, prefix: str = "bench-shards-") -> dict[str, int]:
    """Server sessions on the database per ``application_name`` starting with ``prefix``."""
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT application_name, count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE :p GROUP BY 1"
            ),
            {"p": prefix + "%"},
        ).all()
    return {r[0]: int(r[1]) for r in rows}


def split(store: Store, n: int) -> dict[int, str | None]:
    def ok() -> dict[int, str | None] | None:
        got = owners(store)
        names = {o for o in got.values() if o}
        full = len(got) == K and all(got.values()) and len(names) == n
        return got if full and max(list(got.values()).count(x) for x in names) <= -(-K // n) else None

    found: dict[int, str | None] = wait(ok, 120, f"{K} shards split over {n} instances")
    return found


def release_all(store: Store, n: int) -> float:
    """``n`` runs' tasks made due at once: seconds (the database's clock) until all are READY."""
    ids = submit_runs(store, n)
    t0 = make_due(store, ids)
    done = wait(lambda: (r := released(store, ids))[0] == len(ids) and r, 300, "every retry released")
    return float((done[1] - t0).total_seconds())


def claims(store: Store, shards: set[int], killed: Any) -> dict[str, Any]:
    """When ``shards`` were last claimed, in seconds after ``killed`` (negative: before the kill),
    and how many of them were claimed before it (they had moved before their owner died)."""
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT extract(epoch FROM claimed_at - :k) FROM orc_shards WHERE shard = ANY(:s)"),
            {"k": killed, "s": sorted(shards)},
        ).all()
    after = [float(r[0]) for r in rows if r[0] is not None]
    return {
        "claimed_after_kill_min": min(after, default=None),
        "claimed_after_kill_max": max(after, default=None),
        "claimed_before_kill": sum(1 for a in after if a < 0),
        "shards": len(shards),
    }


def failover_trials(
    store: Store,
    n: int,
    trials: int,
    size: int,
    kill: Callable[[str], None],
    restart: Callable[[str], None],
    detail: list[dict[str, Any]] | None = None,
) -> list[float]:
    """``trials`` times: the owner of shard 0 killed (``kill(owner)``), ``size`` runs made due;
    seconds from the kill until the last of its shards' retries is released; then ``restart``.
    With ``detail``, each trial's :func:`claims` of the victim's shards is appended to it."""
    failovers: list[float] = []
    for _ in range(trials):
        split(store, n)
        by = owners(store)
        victim = str(by[0])
        mine = {s for s, o in by.items() if o == victim}
        batch = submit_runs(store, size)
        theirs = [r for r in batch if shard_of(r, K) in mine]
        if not theirs:
            continue
        kill(victim)
        with store.engine.connect() as conn:
            killed = conn.execute(sa.text("SELECT now()")).scalar_one()
        make_due(store, batch)
        last = wait(lambda: (r := released(store, theirs))[0] == len(theirs) and r, 120, "failover")  # noqa: B023
        failovers.append((last[1] - killed).total_seconds())
        if detail is not None:
            detail.append({"failover": failovers[-1], **claims(store, mine, killed)})
        restart(victim)
    return failovers


def ledger_counts(store: Store) -> tuple[int, int]:
    """(releases applied twice: accepted RETRYING -> READY rows above one per (run, key, attempt),
    writes refused for a stale shard epoch: rejected rows naming it)."""
    with store.engine.connect() as conn:
        twice = conn.execute(
            sa.text(
                "SELECT count(*) FROM (SELECT 1 FROM orc_task_events WHERE accepted AND from_state = 'RETRYING'"
                " AND to_state = 'READY' GROUP BY run_id, key, attempt HAVING count(*) > 1) x"
            )
        ).scalar_one()
        refused = conn.execute(
            sa.text("SELECT count(*) FROM orc_task_events WHERE NOT accepted AND reason LIKE 'stale shard epoch%'")
        ).scalar_one()
    return int(twice), int(refused)


def one(url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    store = Store(url)
    with store.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE orc_shards, orc_shard_config, orc_reconcilers"))
    procs = start(url, range(n), args.lease, args.tick)
    peak: dict[str, int] = {}

    def kill(name: str) -> None:
        victim = procs[int(name.split("-")[1])]
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()

    def restart(name: str) -> None:
        i = int(name.split("-")[1])
        procs[i] = start(url, [i], args.lease, args.tick)[0]  # back under its name

    try:
        split(store, n)
        seconds = release_all(store, args.tasks)
        for k, v in sessions(store).items():
            peak[k] = max(peak.get(k, 0), v)
        failovers: list[float] = []
        if n >= 2:
            failovers = failover_trials(store, n, args.trials, max(args.tasks // 10, 50), kill, restart)
        twice, refused = ledger_counts(store)
    finally:
        stop(procs)
        store.dispose()
    return {
        "instances": n,
        "released": args.tasks,
        "seconds": round(seconds, 3),
        "actions_per_s": round(args.tasks / seconds, 1) if seconds > 0 else None,
        "failover_p50": round(statistics.median(failovers), 2) if failovers else None,
        "failover_p99": round(max(failovers), 2) if failovers else None,
        "failovers": [round(f, 2) for f in failovers],
        "applied_twice": twice,
        "stale_refused": refused,
        "sessions_per_instance": max(peak.values()) if peak else None,
        "sessions_total": sum(peak.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", default="1,2,4,8")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--tick", type=float, default=0.2)
    args = parser.parse_args()
    url = database()
    print(f"K={K} lease={args.lease}s tick={args.tick}s tasks={args.tasks} trials={args.trials} (2 shared cores)")
    header = "instances  actions/s  seconds  failover p50/p99 (s)  applied twice  stale refused  sessions/inst  total"
    print(header)
    for n in (int(x) for x in args.instances.split(",")):
        r = one(url, n, args)
        fo = f"{r['failover_p50']}/{r['failover_p99']}" if r["failover_p50"] is not None else "-"
        print(
            f"{n:<9}  {r['actions_per_s']!s:<9}  {r['seconds']:<7}  {fo:<20}  {r['applied_twice']:<13}"
            f"  {r['stale_refused']:<13}  {r['sessions_per_instance']!s:<13}  {r['sessions_total']}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
