"""Pressure from the database side: what a steady stream of runs does while Postgres is pressed.

Run from the repository root::

    python bench/pressure.py [--scenarios idle_tx,rr_readers,terminate,pool_exhausted,restart]
                             [--before 20] [--during 30] [--idle-during 600] [--after 40] [--json]

One private PostgreSQL server (its own data directory and port: the Debian server binaries, as the
chaos soak's) and one Redis database (``--redis-url``, flushed at the start) carry the whole
run; one real Celery worker (prefork ``-c 2``) runs the tasks. A feeder thread keeps ``--open``
runs of ``1 -> --width -> 1`` no-op tasks in flight, submitting a new one whenever one ends. For
each scenario, in turn:

``before`` seconds unpressed, then ``during`` seconds under the pressure, then ``after``
seconds unpressed again. The pressures, as the cross-system Postgres job-queue benchmark applies
them:

- ``idle_tx``: one session opens a transaction, reads the task table and stays idle in it
  (it holds the xmin horizon: dead rows pile up on the task table) for ``--idle-during``
  seconds (default 600: the ten minutes of the issue);
- ``rr_readers``: four REPEATABLE READ sessions each re-scan the task and ledger tables in
  one long snapshot, back to back;
- ``terminate``: ``pg_terminate_backend`` of every session of the worker's user except ours,
  every second;
- ``pool_exhausted``: another client opens connections until the server refuses more
  (``max_connections``), and holds them;
- ``restart``: the server is stopped (fast) for ``--down`` seconds and started again.

Throughput is read from the database (the ledger's accepted ``SUCCEEDED`` rows, by DB time): tasks
per second before, during and after, and the recovery time (from the pressure's end to the first
second from which the 5-second mean is back to 90 % of the ``before`` rate). At the end every run
is waited for and ``verify`` is run over all of them: lost (a run not final), committed twice, and
violations are printed with what an operator sees (``needs_attention`` runs, the dead tuples on
``orc_tasks``, explain's reasons for tasks still open at the pressure's end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402

from orchestrator import DAG, Orchestrator, Settings  # noqa: E402
from orchestrator.testing.chaos import PrivatePostgres  # noqa: E402

SCENARIOS = ("idle_tx", "rr_readers", "terminate", "pool_exhausted", "restart")


@dataclass
class Window:
    scenario: str
    t0: float  # epoch seconds (DB clock)
    t1: float
    t2: float
    t3: float
    notes: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def db_now(dsn: str) -> float:
    for _ in range(300):
        try:
            with psycopg.connect(dsn, connect_timeout=2) as conn:
                row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
                assert row is not None
                return float(row[0])
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise RuntimeError("the private server does not answer")


class Feeder(threading.Thread):
    """Keeps ``open_runs`` runs in flight; submit errors (the server down, sessions killed) are
    retried: a run is counted as submitted only once ``submit`` returned."""

    def __init__(self, orc: Orchestrator, open_runs: int, width: int) -> None:
        super().__init__(daemon=True)
        self.orc, self.open_runs, self.width = orc, open_runs, width
        self.stop_event = threading.Event()
        self.run_ids: list[str] = []
        self.submit_errors: Counter[str] = Counter()
        self._n = 0

    def dag(self) -> DAG:
        self._n += 1
        dag = DAG(f"pressure_{self._n}")
        root = dag.task("root", "tasks.probes.noop")
        middle = [dag.task(f"m{i}", "tasks.probes.noop", upstream=[root]) for i in range(self.width)]
        dag.task("sink", "tasks.probes.noop", upstream=middle)
        return dag

    def run(self) -> None:
        open_ids: list[str] = []
        while not self.stop_event.is_set():
            try:
                still = []
                for run_id in open_ids:
                    if not self.orc.run_state(run_id).terminal:
                        still.append(run_id)
                open_ids = still
                while len(open_ids) < self.open_runs and not self.stop_event.is_set():
                    handle = self.orc.submit(self.dag())
                    open_ids.append(handle.id)
                    self.run_ids.append(handle.id)
            except Exception as exc:  # noqa: BLE001 - the pressure makes the client fail: count and go on
                self.submit_errors[type(exc).__name__] += 1
                time.sleep(0.2)
                continue
            time.sleep(0.05)


def rates(dsn: str, t0: float, t3: float) -> dict[int, int]:
    """Accepted successes per DB second in [t0, t3)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT floor(extract(epoch FROM at))::bigint, count(*) FROM orc_task_events"
            " WHERE accepted AND to_state = 'SUCCEEDED' AND at >= to_timestamp(%s) AND at < to_timestamp(%s)"
            " GROUP BY 1",
            (t0, t3),
        ).fetchall()
    return {int(s): int(n) for s, n in rows}


def summarize(w: Window, per_second: dict[int, int]) -> dict[str, Any]:
    def mean(a: float, b: float) -> float:
        secs = range(int(a), int(b))
        return sum(per_second.get(s, 0) for s in secs) / max(1, len(secs))

    before, during, after = mean(w.t0, w.t1), mean(w.t1, w.t2), mean(w.t2, w.t3)
    recovery: float | None = None
    for s in range(int(w.t2), int(w.t3) - 4):
        if sum(per_second.get(s + i, 0) for i in range(5)) / 5 >= 0.9 * before:
            recovery = max(0.0, s - w.t2)
            break
    return {
        "scenario": w.scenario,
        "before": round(before, 1),
        "during": round(during, 1),
        "after": round(after, 1),
        "recovery_s": None if recovery is None else round(recovery, 1),
        "notes": w.notes,
        "seen": w.seen,
    }


def operator_view(orc: Orchestrator, dsn: str, run_ids: list[str]) -> dict[str, Any]:
    """What an operator sees now: runs needing attention, dead tuples, explain's reasons."""
    seen: dict[str, Any] = {}
    with contextlib.suppress(Exception), psycopg.connect(dsn, connect_timeout=3) as conn:
        row = conn.execute(
            "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relname = 'orc_tasks'"
        ).fetchone()
        if row:
            seen["orc_tasks_dead_tuples"], seen["orc_tasks_live_tuples"] = int(row[0]), int(row[1])
    reasons: Counter[str] = Counter()
    attention = 0
    for run_id in run_ids[-20:]:
        with contextlib.suppress(Exception):
            view = orc.visible(run_id)
            attention += int(view.needs_attention)
            if not view.state.terminal:
                for e in orc.explain(run_id):
                    for r in e.reasons[:1]:
                        reasons[f"{r.kind}: {r.detail[:60]}"] += 1
    seen["needs_attention_runs"] = attention
    seen["explain"] = dict(reasons.most_common(4))
    return seen


class Pressure:
    def __init__(self, pg: PrivatePostgres, dsn: str, args: argparse.Namespace) -> None:
        self.pg, self.dsn, self.args = pg, dsn, args
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.held: list[psycopg.Connection[Any]] = []
        self.notes: list[str] = []

    def _loop(self, body: Callable[[], None]) -> None:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    body()
                except Exception as exc:  # noqa: BLE001 - a pressing client's own failure is noted, not fatal
                    self.notes.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                    time.sleep(0.5)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def start(self, name: str) -> None:
        if name == "idle_tx":
            conn = psycopg.connect(self.dsn)
            conn.execute("BEGIN")
            conn.execute("SELECT count(*) FROM orc_tasks")
            self.held.append(conn)  # idle in transaction until released
        elif name == "rr_readers":
            for _ in range(4):

                def read() -> None:
                    with psycopg.connect(self.dsn) as conn:
                        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        for _ in range(20):
                            if self.stop.is_set():
                                break
                            conn.execute("SELECT count(*), max(attempt) FROM orc_tasks").fetchone()
                            conn.execute("SELECT count(*) FROM orc_task_events").fetchone()
                        conn.execute("COMMIT")

                self._loop(read)
        elif name == "terminate":

            def kill() -> None:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
                        " AND application_name NOT LIKE 'pressure-%%'"  # the bench's own probes
                    )
                time.sleep(1.0)

            self._loop(kill)
        elif name == "pool_exhausted":
            while True:
                try:
                    self.held.append(psycopg.connect(self.dsn, application_name="pressure-hog", connect_timeout=3))
                except psycopg.OperationalError as exc:
                    self.notes.append(f"held {len(self.held)} connections: {str(exc).splitlines()[0][:80]}")
                    break
                if len(self.held) > 1000:
                    break
        elif name == "restart":
            self.pg.stop("fast")

            def up() -> None:
                time.sleep(self.args.down)
                self.pg.start()
                self.stop.set()

            t = threading.Thread(target=up, daemon=True)
            t.start()
            self.threads.append(t)
        else:
            raise ValueError(name)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        for conn in self.held:
            with contextlib.suppress(Exception):
                conn.close()
        self.held.clear()
        if not self.pg.running:
            self.pg.start()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--before", type=float, default=20.0)
    p.add_argument("--during", type=float, default=30.0)
    p.add_argument("--idle-during", type=float, default=600.0, help="how long idle_tx holds its transaction")
    p.add_argument("--after", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first scenario")
    p.add_argument("--down", type=float, default=5.0, help="restart: seconds the server is down")
    p.add_argument("--open", type=int, default=4, help="runs kept in flight")
    p.add_argument("--width", type=int, default=50, help="each run: 1 -> WIDTH -> 1 no-ops")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    for n in names:
        if n not in SCENARIOS:
            p.error(f"unknown scenario {n!r}; one of {', '.join(SCENARIOS)}")

    pg = PrivatePostgres()
    tmp = Path(tempfile.mkdtemp(prefix="orc-pressure-"))
    worker: subprocess.Popen[bytes] | None = None
    results: list[dict[str, Any]] = []
    try:
        pg.init()
        pg.start()
        url = pg.url.rsplit("/", 1)[0] + "/pressure"
        with psycopg.connect(libpq(pg.url), autocommit=True) as conn:
            conn.execute("CREATE DATABASE pressure")
        dsn = libpq(url) + "?application_name=pressure-bench"
        redis.Redis.from_url(args.redis_url).flushdb()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        env.update(
            {
                "ORCHESTRATOR_DATABASE_URL": url,
                "ORCHESTRATOR_BROKER_URL": args.redis_url,
                "ORCHESTRATOR_DATA_DIR": str(tmp / "data"),
                "ORCHESTRATOR_TICK_SECONDS": "0.5",
                "ORCHESTRATOR_LEASE_SECONDS": "10",
                "ORCHESTRATOR_DISPATCH_TIMEOUT": "10",
                "PYTHONUNBUFFERED": "1",
            }
        )
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "db", "upgrade"], env=env, check=True, cwd=ROOT)
        log = (tmp / "worker.log").open("ab")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config.celery_app", "worker", "-c", str(args.concurrency),
             "--without-gossip", "--without-mingle", "--loglevel", "WARNING"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        from orchestrator.runtime.celery_app import create_app

        settings = Settings.from_env(env)
        orc = Orchestrator(settings, app=create_app(settings, main="pressure"))
        feeder = Feeder(orc, args.open, args.width)
        feeder.start()
        time.sleep(args.warmup)  # the first scenario's "before" is not the workers' warm-up
        for name in names:
            during = args.idle_during if name == "idle_tx" else args.during
            t0 = db_now(dsn)
            time.sleep(args.before)
            pressure = Pressure(pg, dsn, args)
            dead_at_start = operator_view(orc, dsn, []).get("orc_tasks_dead_tuples")
            t1 = db_now(dsn)
            pressure.start(name)
            time.sleep(during)
            seen = {"dead_tuples_at_start": dead_at_start, **operator_view(orc, dsn, feeder.run_ids)}
            pressure.end()
            t2 = db_now(dsn)
            time.sleep(args.after)
            t3 = db_now(dsn)
            w = Window(name, t0, t1, t2, t3, notes=sorted(set(pressure.notes))[:5], seen=seen)
            results.append(summarize(w, rates(dsn, t0, t3)))
            if not args.json:
                print(json.dumps(results[-1]), flush=True)
        feeder.stop_event.set()
        feeder.join(timeout=60)
        deadline = time.monotonic() + 300
        open_runs = list(feeder.run_ids)
        while open_runs and time.monotonic() < deadline:
            open_runs = [r for r in open_runs if not orc.run_state(r).terminal]
            time.sleep(0.5)
        violations = orc.verify(feeder.run_ids, allow_dead_letter=True)
        summary = {
            "runs": len(feeder.run_ids),
            "tasks": len(feeder.run_ids) * (args.width + 2),
            "lost": len(open_runs),
            "violations": violations[:10],
            "violation_count": len(violations),
            "submit_errors": dict(feeder.submit_errors),
            "scenarios": results,
        }
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(f"\n{'scenario':<16}{'before':>9}{'during':>9}{'after':>9}{'recovery':>10}  operator sees")
            for r in results:
                rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.0f} s"
                print(
                    f"{r['scenario']:<16}{r['before']:>9.1f}{r['during']:>9.1f}{r['after']:>9.1f}{rec:>10}  {r['seen']}"
                )
            print(
                f"\n{summary['runs']} runs ({summary['tasks']} tasks): lost {summary['lost']},"
                f" violations {summary['violation_count']}, submit errors {summary['submit_errors']}"
            )
            for v in violations[:10]:
                print(f"violation: {v}")
        return 1 if open_runs or violations else 0
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        pg.close()


if __name__ == "__main__":
    sys.exit(main())
