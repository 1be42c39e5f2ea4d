"""Time held in the deployment's serialised sections per task (issue 35): the admission locks,
the reconciler's duty lock, keyed flow control's and the events' per-key locks, over a fan-out
1 -> N -> 1 and a chain on one real worker (``-c 2``), optionally with two workers on two queue
groups admitting at once (``--groups 2``). Run from the repository root; it re-creates its
database and flushes its Redis database, like ``bench.py``::

    python -m bench.locks [--fanout 2000] [--chain 500] [--groups 1|2] [--hz 500]
                          [--database-url URL] [--redis-url URL]
    python -m bench.locks --fairness 3 [--fairness-tasks 3000]   # bench.py's fairness scenario only

Two measures, neither depending on clocks inside a lock's holder:

- **sampled** (any release): a thread reads ``pg_locks`` (advisory locks of the bench database) at
  ``--hz``; a lock's share of samples with a holder, times the phase's wall time, over its tasks, is
  its time held per task (commit included), the mean number of waiters the same way its time
  waited for per task. ``1 / held per task`` is the ceiling the section puts on the whole
  deployment's tasks per second, whatever its hardware.
- **timed** (the server functions of revision 0036 on): with ``orc.bench_locks = on`` (set here
  for the bench database only) the admission functions add one row per lock taken to the unlogged
  table ``orc_bench_locks``: how long the lock call waited, and how long the lock was then held up
  to the end of the function that took it (the rest of its transaction and the commit come on
  top: the sampled figure has them). Without the setting the functions pay one
  ``current_setting`` per call and write nothing.

With them, the admission's server functions' calls and time per task (``track_functions = all``
on the bench database): what admitting costs the server, whatever the load.

The machine has 2 cores and may be shared: the held times are what a task costs in the section,
the waits depend on the load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_locks"
REDIS = "redis://127.0.0.1:6379/13"
#: the single-key admission lock of every release before 0036; from 0036 the cross-group lock
#: (limits, breakers) only
ADMISSION_LOCK = 1869767425
RECONCILER_LOCK = 0x6F7263_02

SAMPLE = """
SELECT l.classid::bigint, l.objid::bigint, l.objsubid::int, l.granted, count(*)
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
GROUP BY 1, 2, 3, 4
"""

BENCH_TABLE = """
CREATE UNLOGGED TABLE IF NOT EXISTS orc_bench_locks (
    section text NOT NULL, waited_us float8 NOT NULL, held_us float8 NOT NULL, at timestamptz DEFAULT clock_timestamp()
)
"""


def kind(classid: int, objid: int, objsubid: int) -> str:
    """What an advisory lock of ``pg_locks`` is (a bigint key is classid:objid, objsubid 1)."""
    if objsubid == 1 and classid == 0 and objid == ADMISSION_LOCK:
        return "admission / cross-group (limits, breakers)"
    if objsubid == 1 and classid == 0 and objid == RECONCILER_LOCK:
        return "reconciler duty (session)"
    if objsubid == 2 and classid == ADMISSION_LOCK:
        return "admission per queue (0036)"
    if objsubid == 2:
        return "event key (per tenant/key)"
    return "other single key (flow key, migration)"


class Sampler:
    """Reads the bench database's advisory locks at ``hz`` in a thread of its own."""

    def __init__(self, url: str, hz: float) -> None:
        import psycopg

        self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
        self.interval = 1.0 / hz
        self.samples = 0
        #: samples with a holder, per lock (kind, classid, objid); waiters per kind
        self.held: Counter[tuple[str, int, int]] = Counter()
        self.waiting: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with self.conn.cursor() as cur:
            while not self._stop.is_set():
                cur.execute(SAMPLE)
                self.samples += 1
                for classid, objid, objsubid, granted, n in cur.fetchall():
                    k = kind(classid, objid, objsubid)
                    if granted:
                        self.held[k, classid, objid] += 1  # a sample with a holder (exclusive: one)
                    else:
                        self.waiting[k] += n
                time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        self.conn.close()

    def figures(self, tasks: int) -> dict[str, dict[str, float]]:
        """Per kind of lock: the busiest lock of the kind (held per task, share of the time: a lock
        per queue is one group's ceiling), how many locks of the kind were seen held, and the
        waits on all of them (every waiter's time, per task)."""
        out: dict[str, dict[str, float]] = {}
        for k in sorted({h[0] for h in self.held} | set(self.waiting)):
            mine = [n for h, n in self.held.items() if h[0] == k]
            busiest = max(mine, default=0) / max(self.samples, 1)
            wait = self.waiting[k] / max(self.samples, 1) * self.elapsed / tasks
            out[k] = {
                "held_ms": busiest * self.elapsed / tasks * 1000,
                "wait_ms": wait * 1000,
                "busy": busiest,
                "locks": len(mine),
            }
        return out


def timed(engine: Any, since: Any, tasks: int) -> dict[str, dict[str, float]]:
    """The rows the server functions wrote to ``orc_bench_locks`` since ``since``, per section."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        if conn.execute(sa.text("SELECT to_regclass('orc_bench_locks')")).scalar_one() is None:
            return {}
        found = conn.execute(
            sa.text(
                "SELECT section, count(*), sum(waited_us), sum(held_us), max(waited_us) FROM orc_bench_locks"
                " WHERE at > :since GROUP BY section ORDER BY section"
            ),
            {"since": since},
        ).all()
    return {
        str(section): {
            "per_task": n / tasks,
            "wait_ms": waited / tasks / 1000,
            "held_ms": held / tasks / 1000,
            "max_wait_ms": most / 1000,
        }
        for section, n, waited, held, most in found
    }


#: the admission's server functions whose time per task is printed
FUNCTIONS = ("orc_admit_v2", "orc_admission_lock_v1", "orc_pass_slot_v2", "orc_admit_from_v2", "orc_limit_held_v2")


def functions(engine: Any) -> dict[str, tuple[int, float, float]]:
    """calls, total and self milliseconds of the admission's functions so far (track_functions)."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        found = conn.execute(
            sa.text(
                "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions WHERE funcname = ANY(:f)"
            ),
            {"f": list(FUNCTIONS)},
        ).all()
    return {str(n): (int(c), float(t), float(s)) for n, c, t, s in found}


def print_functions(
    before: dict[str, tuple[int, float, float]], after: dict[str, tuple[int, float, float]], tasks: int
) -> None:
    print(f"  {'server functions (track_functions)':44s} {'calls/task':>10s} {'total/task':>10s} {'self/task':>10s}")
    for name in FUNCTIONS:
        if name not in after:
            continue
        c0, t0, s0 = before.get(name, (0, 0.0, 0.0))
        c1, t1, s1 = after[name]
        print(f"  {name:44s} {(c1 - c0) / tasks:10.3f} {(t1 - t0) / tasks:8.4f}ms {(s1 - s0) / tasks:8.4f}ms")


def print_phase(name: str, tasks: int, elapsed: float, sampler: Sampler, server: dict[str, dict[str, float]]) -> None:
    print(f"\n{name}: {tasks} tasks in {elapsed:.2f}s = {tasks / elapsed:.0f} tasks/s ({sampler.samples} samples)")
    print(
        f"  {'sampled (pg_locks), busiest lock of each kind':44s} {'held/task':>10s} {'wait/task':>10s}"
        f" {'busy':>6s} {'ceiling':>12s}  locks"
    )
    for k, f in sampler.figures(tasks).items():
        if k.startswith("reconciler duty"):
            # a session lock held by the reconciler on duty all along: no task takes or waits for it
            print(f"  {k:44s} held {f['busy']:.0%} of the time by the reconciler on duty; no task's path takes it")
            continue
        ceiling = f"{1000 / f['held_ms']:.0f}/s" if f["held_ms"] > 0 else "-"
        print(
            f"  {k:44s} {f['held_ms']:8.4f}ms {f['wait_ms']:8.4f}ms {f['busy']:6.1%} {ceiling:>12s}  {f['locks']:.0f}"
        )
    if server:
        head = f"{'locks/task':>10s} {'held/task':>10s} {'wait/task':>10s} {'max wait':>9s}"
        print(f"  {'timed (orc_bench_locks)':44s} {head}")
        for k, f in server.items():
            ceiling = f"{1000 / f['held_ms']:.0f}/s" if f["held_ms"] > 0 else "-"
            print(
                f"  {k:44s} {f['per_task']:10.3f} {f['held_ms']:8.4f}ms {f['wait_ms']:8.4f}ms"
                f" {f['max_wait_ms']:7.2f}ms  ceiling {ceiling}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fanout", type=int, default=2000, help="middle tasks of the fan-out (0 skips it), default 2000")
    p.add_argument("--chain", type=int, default=500, help="links of the chain (0 skips it), default 500")
    p.add_argument(
        "--groups", type=int, choices=(1, 2), default=1,
        help="2: a second worker on a queue of its own, each worker's fan-out (and chain) at once",
    )  # fmt: skip
    p.add_argument("--hz", type=float, default=500.0, help="pg_locks samples per second, default 500")
    p.add_argument("--fairness", type=int, default=0, help="run only bench.py's fairness scenario, this many times")
    p.add_argument("--fairness-tasks", type=int, default=3000, help="tenant A's backlog in it, default 3000")
    p.add_argument("--database-url", default=DB, help=f"bench database (re-created!), default {DB}")
    p.add_argument("--redis-url", default=REDIS, help=f"bench Redis database (flushed!), default {REDIS}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take, default 300")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(
        ORCHESTRATOR_DATABASE_URL=args.database_url,
        ORCHESTRATOR_BROKER_URL=args.redis_url,
        ORCHESTRATOR_DATA_DIR=tempfile.mkdtemp(prefix="orc-locks-"),
        ORCHESTRATOR_TASK_MODULES="tasks.probes,tasks.etl,bench.raw_tasks",
    )
    import redis
    import sqlalchemy as sa

    import bench.bench as b
    from orchestrator.core.routing import default_queues

    b.reset_database(args.database_url)
    engine = sa.create_engine(args.database_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(BENCH_TABLE)  # before any worker: the functions write to it
    engine.dispose()
    name = sa.engine.make_url(args.database_url).database
    admin = sa.create_engine(
        sa.engine.make_url(args.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f"ALTER DATABASE \"{name}\" SET orc.bench_locks = 'on'")
        conn.exec_driver_sql(f"ALTER DATABASE \"{name}\" SET track_functions = 'all'")
    admin.dispose()
    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logdir = Path(os.environ["ORCHESTRATOR_DATA_DIR"])
    workers = [b.Worker(env=env, concurrency=2, queues=",".join(default_queues()), logfile=logdir / "w0.log")]
    if args.groups == 2:
        workers.append(b.Worker(env=env, concurrency=2, queues="orc-locks.g1", logfile=logdir / "w1.log", name="g1"))
    bench_args = b.parse_args(["--fairness-tasks", str(args.fairness_tasks), "--timeout", str(args.timeout)])
    bench = b.Bench(bench_args, workers[0], r)
    try:
        for w in workers:
            w.start()
        bench.warm_up()
        if len(workers) == 2:
            bench.run_dag(b.fanout_dag(20, "warm-g1", queue="orc-locks.g1"), analyze=False)
        if args.fairness:
            return fairness(bench, args.fairness)
        if args.fanout:
            phase(
                bench,
                args,
                "fan-out",
                lambda q, i: b.fanout_dag(args.fanout, f"locks-fan{i}", queue=q),
                args.fanout + 2,
            )
        if args.chain:
            phase(bench, args, "chain", lambda q, i: chain_dag(args.chain, f"locks-chain{i}", q), args.chain)
        return 0
    finally:
        for w in workers:
            w.stop()
        r.flushdb()
        bench.orchestrator().store.dispose()


def chain_dag(n: int, name: str, queue: str | None) -> Any:
    from bench.bench import NOOP
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    prev = None
    for i in range(n):
        prev = dag.task(f"c{i:05d}", NOOP, upstream=[prev] if prev is not None else [], queue=queue)
    return dag


def phase(bench: Any, args: argparse.Namespace, name: str, make: Any, per_run: int) -> None:
    """Submit one run per worker group at once and wait for them all, sampling meanwhile."""
    import sqlalchemy as sa

    orc = bench.orchestrator()
    queues = [None, "orc-locks.g1"][: args.groups]
    with orc.store.engine.connect() as conn:
        since = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    calls = functions(orc.store.engine)
    with Sampler(args.database_url, args.hz) as sampler:
        t0 = time.perf_counter()
        runs = [orc.submit(make(q, i)) for i, q in enumerate(queues)]
        for run in runs:
            view = run.wait(args.timeout, poll=0.01)
            if view.state.value != "SUCCEEDED":
                raise SystemExit(f"run {run.id} ended {view.state.value}")
        elapsed = time.perf_counter() - t0
    tasks = per_run * len(runs)
    label = f"{name} x{len(runs)} groups" if len(runs) > 1 else name
    time.sleep(0.7)  # the statistics are flushed every 500 ms
    print_phase(label, tasks, elapsed, sampler, timed(orc.store.engine, since, tasks))
    print_functions(calls, functions(orc.store.engine), tasks)


def sequence(bench: Any, dag_name: str) -> str:
    """The tenants of the admissions from the last run named ``dag_name``'s submit to its last
    admission, in order ('|' where the admitting transaction changes)."""
    import sqlalchemy as sa

    with bench.orchestrator().store.engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "WITH b AS (SELECT id FROM orc_runs WHERE dag_name = :d ORDER BY created_at DESC LIMIT 1),"
                " span AS (SELECT min(e.id) AS lo, max(e.id) FILTER (WHERE e.to_state = 'QUEUED') AS hi"
                "          FROM orc_task_events e, b WHERE e.run_id = b.id)"
                " SELECT t.tenant, e.at FROM orc_task_events e"
                " JOIN orc_tasks t ON t.run_id = e.run_id AND t.key = e.key, span"
                " WHERE e.id > span.lo AND e.id <= span.hi AND e.to_state = 'QUEUED' AND e.accepted ORDER BY e.id"
            ),
            {"d": dag_name},
        ).all()
    out, last = [], None
    for tenant, at in found:
        if last is not None and at != last:
            out.append("|")
        out.append(str(tenant)[-1])
        last = at
    return "".join(out)


def fairness(bench: Any, times: int) -> int:
    """bench.py's fairness scenario ``times`` times on the same worker; prints each reading."""
    readings: dict[str, list[float]] = {"equal": [], "3:1": []}
    for i in range(times):
        bench.bench_fairness()
        got = bench.results["fairness"]
        for label in readings:
            readings[label].append(got[label]["a_to_b"])
        print(f"fairness #{i + 1}: " + ", ".join(f"{k} {got[k]['share']} = {got[k]['a_to_b']:.2f}" for k in readings))
        print(f"  3:1 admissions in order (a/b, | between transactions): {sequence(bench, 'b-3:1')}")
    for label, values in readings.items():
        print(f"fairness {label}: " + ", ".join(f"{v:.2f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
