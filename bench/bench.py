"""Benchmark: raw Celery vs orchestrated DAGs on one Redis and one real Celery worker.

Run from the repository root::

    /work/venv/bin/python bench/bench.py [--concurrency 2] [--json]

In one run, against the same Redis database and the same ``celery worker`` subprocess
(prefork, acks_late, prefetch multiplier 1) it measures:

1. raw Celery throughput: ``--raw-tasks`` plain no-op tasks sent with ``send_task``;
2. orchestrated throughput of a fan-out/fan-in DAG (1 root -> ``--fanout`` no-ops -> 1 sink)
   and of a ``--chain``-node chain, each from ``submit`` until the run is final;
3. the wall time of ``Orchestrator.submit`` for a ``--submit-nodes``-node DAG (done last,
   in a separate database, on a queue no worker consumes);
4. p50/p99 of parent ``finished_at`` -> child ``started_at`` (both DB ``now()``) over the
   chain's edges;
5. references and probes: a raw Celery chain (each link sends the next), and the cost of
   the worker's child-counter update in a new run before and after ANALYZE
   (``--planner-probe``; the measured runs are not ANALYZEd unless ``--planner-stats`` says so);
6. fairness and priority (``--fairness-tasks``): tenants' shares of the slots, a small
   tenant's run behind a big backlog, a high task behind a low backlog;
7. limits: the most tasks of a 2-slot pool running at once under 50 tasks (from the ledger);
   with two fresh workers whose leases are ``--lease`` seconds, how soon a pool's slots are
   used again after the worker holding them is killed with -9, and after a run holding one is
   cancelled;
8. dynamic DAGs (issue 19): the commit time of a map's expansion (a probe with no worker, in
   every run), and with ``--maps`` on the worker: a map of ``--map-n`` items against the same
   fan-out written out statically, a 3-stage chained map (depth first?), and a map of
   ``--map-big-n`` items to the end with the worker's memory sampled (``--no-map-big`` skips it).

The bench databases (their name must contain "bench") are dropped and re-created, and
the bench Redis database is flushed, at the start of every run. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import io
import json
import os
import platform
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench"
DEFAULT_REDIS = "redis://127.0.0.1:6379/9"
TASK_MODULES = "tasks.probes,tasks.etl,bench.raw_tasks"
NOOP = "tasks.probes.noop"
#: the submit benchmark's nodes go to this queue, which the bench worker does not consume
UNCONSUMED_QUEUE = "orc-bench.unconsumed"

PLANNER_STATS = {
    "run": "orc_* tables ANALYZEd after the warm-up and right after each measured submit, inside the timed span",
    "warmup": "orc_* tables ANALYZEd after the warm-up only: the planner does not know the measured runs",
    "none": "orc_* tables never ANALYZEd",
}

TARGET_FANOUT_RATIO = 0.5
#: issue 35's targets, one sitting: the fan-out at >= 0.85x a Celery chord of the same shape, a
#: chain link <= 2.0 ms and below the canvas chain's, <= 1.5 database transactions per task, and
#: <= 0.6 ms of Postgres CPU per prefork task (the bench database's backends over the fan-out)
TARGET_CHORD_RATIO = 0.85
TARGET_SUBMIT_S = 0.3
TARGET_P99_MS = 15.0
TARGET_CHAIN_STEP_MS = 2.0
TARGET_TRANSACTIONS = 1.5
TARGET_PG_CPU_MS = 0.6
#: dynamic DAGs (issue 19): a map must run its children at least as fast as the static fan-out
TARGET_MAP_RATIO = 1.0
#: the source's success that expands a map of --map-n items, committed within
TARGET_EXPAND_S = 0.5
#: a --map-big-n map: the largest worker process's peak RSS, and source success -> first child started
TARGET_MAP_RSS_MB = 300.0
TARGET_FIRST_CHILD_S = 2.0
#: issue 33: a 100,000-item map against a static fan-out of the same width, its lowest 10-second
#: rate against its mean, and a 2-task run of the same tenant behind it ("within seconds")
TARGET_BIG_MAP_TO_STATIC = 0.9
TARGET_WINDOW_TO_MEAN = 0.5
TARGET_SMALL_BEHIND_MAP_S = 10.0
#: stages of the chained map
CHAINED_DEPTH = 3
#: bench-only orchestrated tasks (bench/raw_tasks.py): the map's source, and a no-op taking the item
LISTING = "bench.listing"
MAP_ITEM = "bench.map_item"


def fanout_dag(n: int, name: str, *, queue: str | None = None) -> Any:
    """1 root -> ``n`` middle no-ops -> 1 sink."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    root = dag.task("root", NOOP, queue=queue)
    mids = [dag.task(f"m{i:05d}", NOOP, upstream=[root], queue=queue) for i in range(n)]
    dag.task("sink", NOOP, upstream=mids, queue=queue)
    return dag


def map_dag(n: int, name: str, *, queue: str | None = None) -> Any:
    """1 source (``bench.listing``: ``n`` items) -> ``dag.map`` of ``bench.map_item`` over its
    result (``n`` children) -> 1 sink."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    source = dag.task("source", LISTING, kwargs={"n": n}, queue=queue)
    mapped = dag.map("m", MAP_ITEM, over=source, kwarg="item", max_map_length=max(n, 1), queue=queue)
    dag.task("sink", NOOP, upstream=[mapped], queue=queue)
    return dag


def static_map_dag(n: int, name: str) -> Any:
    """:func:`map_dag`'s shape written out statically: the same source, ``n`` ``bench.map_item``
    nodes each given its item as a constant kwarg, 1 sink (the map's reference)."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    source = dag.task("source", LISTING, kwargs={"n": n})
    mids = [dag.task(f"m{i:06d}", MAP_ITEM, kwargs={"item": i}, upstream=[source]) for i in range(n)]
    dag.task("sink", NOOP, upstream=mids)
    return dag


def chained_map_dag(n: int, name: str, depth: int = CHAINED_DEPTH) -> Any:
    """1 source (``n`` items) -> map ``s1`` -> map ``s2`` over ``s1`` ... -> map ``s<depth>`` -> 1
    sink: a chained map, item by item (child k of a stage waits for child k of the stage before)."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    prev = dag.task("source", LISTING, kwargs={"n": n})
    for stage in range(1, depth + 1):
        prev = dag.map(f"s{stage}", MAP_ITEM, over=prev, kwarg="item", max_map_length=max(n, 1))
    dag.task("sink", NOOP, upstream=[prev])
    return dag


class BenchError(RuntimeError):
    """The benchmark could not complete (worker died, a run failed, a timeout)."""


# ---------------------------------------------------------------------------- helpers


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (``p`` in 0..100) of a non-empty list."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min_ms": min(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "max_ms": max(values),
        "mean_ms": statistics.fmean(values),
    }


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def reset_database(url: str) -> None:
    """Drop and re-create the bench database (refused unless its name contains 'bench')."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    name = u.database or ""
    if not u.drivername.startswith("postgresql"):
        raise SystemExit(f"--database-url must be PostgreSQL, not {u.drivername}")
    if "bench" not in name or not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise SystemExit(
            f"refusing to reset database {name!r}: the bench drops and re-creates its database,"
            " so its name must contain 'bench' (letters, digits, '_')"
        )
    admin = sa.create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        admin.dispose()
    from orchestrator.store import make_engine, migrate

    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()


def server_setting(url: str, name: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("select current_setting(:n)"), {"n": name}).scalar_one())
    finally:
        engine.dispose()


def derived_url(url: str, suffix: str) -> str:
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    return u.set(database=f"{u.database}{suffix}").render_as_string(hide_password=False)


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child before exec
    """Linux: SIGTERM the worker if the bench process dies without cleaning up."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class TreeMemory:
    """Samples, from ``/proc`` (Linux), the memory of every process of a process group (the
    worker: its main process and its pool children) every ``interval`` seconds in a thread:
    the peak RSS of the largest process, and the peaks of the group's RSS sum and PSS sum
    (PSS shares the pages the children inherited from the main process among them)."""

    def __init__(self, pgid: int, interval: float = 0.2) -> None:
        import threading

        self.pgid = pgid
        self.interval = interval
        self.peak_process_kb = 0
        self.peak_process_main = False
        self.peak_rss_sum_kb = 0
        self.peak_pss_sum_kb = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orc-bench-rss", daemon=True)

    def pids(self) -> list[int]:
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getpgid(int(entry.name)) == self.pgid:
                        found.append(int(entry.name))
        return found

    @staticmethod
    def field_kb(path: str, name: str) -> int:
        """A ``name: <n> kB`` line of a /proc file (0 when the process is gone)."""
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(name + ":"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def sample(self) -> dict[int, int]:
        rss = {pid: self.field_kb(f"/proc/{pid}/status", "VmRSS") for pid in self.pids()}
        pss = sum(self.field_kb(f"/proc/{pid}/smaps_rollup", "Pss") for pid in rss)
        if rss:
            pid, top = max(rss.items(), key=lambda kv: kv[1])
            if top > self.peak_process_kb:
                self.peak_process_kb, self.peak_process_main = top, pid == self.pgid
            self.peak_rss_sum_kb = max(self.peak_rss_sum_kb, sum(rss.values()))
            self.peak_pss_sum_kb = max(self.peak_pss_sum_kb, pss)
            self.samples += 1
        return rss

    def high_water_kb(self) -> dict[int, int]:
        """Each live process's VmHWM (its peak RSS over its whole life, earlier phases included)."""
        return {pid: self.field_kb(f"/proc/{pid}/status", "VmHWM") for pid in self.pids()}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.sample()

    def figures(self) -> dict[str, Any]:
        mb = 1024.0
        return {
            "peak_process_mb": self.peak_process_kb / mb,
            "peak_process_is_main": self.peak_process_main,
            "peak_rss_sum_mb": self.peak_rss_sum_kb / mb,
            "peak_pss_sum_mb": self.peak_pss_sum_kb / mb,
            "samples": self.samples,
            "interval_s": self.interval,
        }


# ---------------------------------------------------------------------------- worker


@dataclass
class Worker:
    """A real ``celery worker`` subprocess in its own process group."""

    env: dict[str, str]
    concurrency: int
    queues: str
    logfile: Path
    proc: subprocess.Popen[bytes] | None = None
    app_module: str = "config.celery_app"
    #: tells workers of one bench apart (their names are orc-bench-<app>-<pid><name>@host)
    name: str = ""

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app_module, "worker",
            "-c", str(self.concurrency), "--pool", "prefork", "-Q", self.queues,
            "--without-gossip", "--without-mingle", "--loglevel", "WARNING",
            "-n", f"orc-bench-{self.app_module.rsplit('.', 1)[-1]}-{os.getpid()}{self.name}@%h",
        ]  # fmt: skip
        out = self.logfile.open("wb")
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        finally:
            out.close()
        log(f"worker pid {self.proc.pid}: {' '.join(cmd[1:])} (log: {self.logfile})")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise BenchError(f"the worker exited with code {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no worker log)"

    def kill(self) -> None:
        """kill -9 of the whole process group (main process and pool children)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            log(f"worker {proc.pid} killed with SIGKILL")

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM) of the whole process group, SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the worker leads its own process group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"worker {pgid} did not stop within {timeout:g}s: SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        # pool children that outlived the main process, if any
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        log(f"worker {pgid} stopped (exit code {proc.returncode})")


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, worker: Worker, interval: float = 0.002
) -> float:
    """Poll ``predicate`` until true; returns the perf_counter() at which it was seen true."""
    deadline = time.monotonic() + timeout
    last_check = 0.0
    while True:
        if predicate():
            return time.perf_counter()
        now = time.monotonic()
        if now >= deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        if now - last_check > 0.5:
            worker.check_alive()
            last_check = now
        time.sleep(interval)


# ---------------------------------------------------------------------------- phases


@dataclass
class Bench:
    args: argparse.Namespace
    worker: Worker
    redis: Any
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def app(self) -> Any:
        from orchestrator.runtime.celery_app import get_app

        return get_app()

    # -------------------------------------------------------------- 1. raw Celery

    def send_raw(self, n: int) -> tuple[float, float]:
        from bench.raw_tasks import RAW_COUNTER, RAW_TASK

        self.redis.delete(RAW_COUNTER)
        app = self.app
        t0 = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for _ in range(n):
                app.send_task(RAW_TASK, queue="orchestrator.default", producer=producer)
        t_published = time.perf_counter()
        t_done = wait_until(
            lambda: int(self.redis.get(RAW_COUNTER) or 0) >= n, self.args.timeout, f"{n} raw tasks", self.worker
        )
        return t_published - t0, t_done - t0

    def bench_raw(self) -> None:
        n = self.args.raw_tasks
        publish_s, total_s = self.send_raw(n)
        self.results["raw"] = {
            "tasks": n,
            "publish_s": publish_s,
            "elapsed_s": total_s,
            "tasks_per_s": n / total_s,
        }
        log(f"raw Celery: {n} tasks in {total_s:.3f}s = {n / total_s:.1f} tasks/s (publish {publish_s:.3f}s)")

    def bench_raw_chain(self) -> None:
        """Reference for the chain and the hop latency: a plain Celery chain, each link
        sending the next one at the end of its body."""
        from bench.raw_tasks import RAW_CHAIN_TASK, RAW_CHAIN_TIMES

        n = self.args.chain
        self.redis.delete(RAW_CHAIN_TIMES)
        t0 = time.perf_counter()
        self.app.send_task(RAW_CHAIN_TASK, args=[0, n, "orchestrator.default"], queue="orchestrator.default")
        t_done = wait_until(
            lambda: int(self.redis.llen(RAW_CHAIN_TIMES)) >= n, self.args.timeout, f"a raw chain of {n}", self.worker
        )
        elapsed = t_done - t0
        links: dict[int, tuple[float, float]] = {}
        for item in self.redis.lrange(RAW_CHAIN_TIMES, 0, -1):
            index, start, end = item.decode().split()
            links[int(index)] = (float(start), float(end))
        hops = [(links[i + 1][0] - links[i][1]) * 1000.0 for i in range(n - 1)]
        self.results["raw_chain"] = {
            "tasks": n,
            "elapsed_s": elapsed,
            "tasks_per_s": n / elapsed,
            "step_ms": elapsed / n * 1000.0,
            "hop": summary_ms(hops) if hops else None,
        }
        log(f"raw Celery chain {n}: {elapsed:.3f}s = {n / elapsed:.1f} tasks/s ({elapsed / n * 1000:.2f} ms per step)")

    # -------------------------------------------------------------- 2. orchestrated

    def orchestrator(self) -> Any:
        from orchestrator.engine.facade import Orchestrator

        if not hasattr(self, "_orc"):
            self._orc = Orchestrator(app=self.app)
        return self._orc

    def run_dag(self, dag: Any, *, analyze: bool | None = None, timeout: float | None = None) -> tuple[Any, float]:
        """Submit ``dag`` and wait for its run (``timeout``: default ``--timeout``); with
        ``analyze`` (default: ``--planner-stats run``) ANALYZE the tables right after the
        submit, inside the timed span."""
        orc = self.orchestrator()
        if analyze is None:
            analyze = self.args.planner_stats == "run"
        t0 = time.perf_counter()
        run = orc.submit(dag)
        if analyze:
            self.analyze()
        view = run.wait(self.args.timeout if timeout is None else timeout, poll=0.01)
        elapsed = time.perf_counter() - t0
        if view.state.value != "SUCCEEDED":
            raise BenchError(f"run {run.id} of {dag.name} ended {view.state.value}: {view.counts}")
        return run, elapsed

    def db_figures(self, run_id: str) -> dict[str, Any]:
        """DB-clock figures of a run: created -> finished, per-task started -> finished."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            span = conn.execute(
                sa.text("select extract(epoch from finished_at - created_at) from orc_runs where id = :r"),
                {"r": run_id},
            ).scalar_one()
            service = [
                float(v) * 1000.0
                for (v,) in conn.execute(
                    sa.text(
                        "select extract(epoch from finished_at - started_at) from orc_tasks"
                        " where run_id = :r and started_at is not null and finished_at is not null"
                    ),
                    {"r": run_id},
                )
            ]
            queued = [
                float(v) * 1000.0
                for (v,) in conn.execute(
                    sa.text(
                        "select extract(epoch from started_at - dispatched_at) from orc_tasks"
                        " where run_id = :r and started_at is not null and dispatched_at is not null"
                    ),
                    {"r": run_id},
                )
            ]
            rejected = conn.execute(
                sa.text("select count(*) from orc_task_events where run_id = :r and not accepted"), {"r": run_id}
            ).scalar_one()
        return {
            "db_span_s": float(span),
            "claim_to_commit": summary_ms(service),
            "dispatch_to_claim": summary_ms(queued),
            "rejected_events": rejected,
        }

    def bench_fanout(self) -> None:
        import sqlalchemy as sa

        n = self.args.fanout
        engine = self.orchestrator().store.engine
        own = [0]  # this process's own transactions (submit, polling the run) are not the workers'

        def count(*_: Any) -> None:
            own[0] += 1

        before = self.transactions()
        cpu0 = self.backend_cpu()
        # each of this process's checkouts pings (its own transaction), then each begins one
        sa.event.listen(engine, "begin", count)
        sa.event.listen(engine.pool, "checkout", count)
        try:
            run, elapsed = self.run_dag(fanout_dag(n, "bench_fanout"))
        finally:
            sa.event.remove(engine, "begin", count)
            sa.event.remove(engine.pool, "checkout", count)
        cpu1 = self.backend_cpu()
        time.sleep(0.6)  # the statistics collector flushes every 500 ms
        per_task = (self.transactions() - before - own[0] - 1) / (n + 2)
        both = set(cpu0) & set(cpu1)
        pg_cpu_ms = sum(cpu1[p] - cpu0[p] for p in both) / (n + 2) * 1000.0
        figures = self.db_figures(run.id)
        raw = self.results["raw"]["tasks_per_s"]
        self.results["fanout"] = {
            "run_id": run.id,
            "middle_tasks": n,
            "total_tasks": n + 2,
            "elapsed_s": elapsed,
            "tasks_per_s": n / elapsed,
            "all_tasks_per_s": (n + 2) / elapsed,
            "ratio_to_raw": n / elapsed / raw,
            "transactions_per_task": per_task,
            "postgres_cpu_ms_per_task": pg_cpu_ms,
            "postgres_backends_measured": len(both),
            **figures,
        }
        log(f"fan-out 1->{n}->1: {elapsed:.3f}s = {n / elapsed:.1f} middle tasks/s ({n / elapsed / raw:.2f}x raw)")
        log(f"  Postgres CPU {pg_cpu_ms:.3f} ms per task ({len(both)} backends of the bench database)")

    def bench_chain(self) -> None:
        from orchestrator.core.dag import DAG

        n = self.args.chain
        dag = DAG("bench_chain")
        prev = None
        for i in range(n):
            prev = dag.task(f"c{i:05d}", NOOP, upstream=[prev] if prev is not None else [])
        run, elapsed = self.run_dag(dag)
        figures = self.db_figures(run.id)
        raw = self.results["raw"]["tasks_per_s"]
        raw_chain = self.results["raw_chain"]["tasks_per_s"]
        self.results["chain"] = {
            "run_id": run.id,
            "tasks": n,
            "elapsed_s": elapsed,
            "tasks_per_s": n / elapsed,
            "ratio_to_raw": n / elapsed / raw,
            "ratio_to_raw_chain": n / elapsed / raw_chain,
            "step_ms": elapsed / n * 1000.0,
            **figures,
        }
        log(f"chain {n}: {elapsed:.3f}s = {n / elapsed:.1f} tasks/s ({elapsed / n * 1000:.2f} ms per step)")

    # -------------------------------------------------------------- dynamic DAGs (maps)

    def map_timeout(self, tasks: int) -> float:
        """A phase of ``tasks`` tasks may take ``--timeout`` or 10 ms per task, the longer."""
        return max(self.args.timeout, tasks / 100.0)

    def map_figures(self, run_id: str, header: str) -> dict[str, Any]:
        """DB-clock figures of a map: its children, the source's ``finished_at`` (``now()`` of its
        succeed transaction, which expanded the map), the earliest child's ``started_at``."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "select s.finished_at, h.state, h.map_total,"
                    " (select count(*) from orc_tasks c where c.run_id = :r and c.map_parent = :h),"
                    " (select count(*) from orc_tasks c where c.run_id = :r and c.map_parent = :h"
                    "   and c.state = 'SUCCEEDED'),"
                    " (select min(c.started_at) from orc_tasks c where c.run_id = :r and c.map_parent = :h),"
                    " (select max(c.finished_at) from orc_tasks c where c.run_id = :r and c.map_parent = :h),"
                    " (select extract(epoch from finished_at - created_at) from orc_runs where id = :r)"
                    " from orc_tasks s join orc_tasks h on h.run_id = s.run_id and h.key = :h"
                    " where s.run_id = :r and s.key = 'source'"
                ),
                {"r": run_id, "h": header},
            ).one()
        source_done, state, total, children, succeeded, first_start, last_done, span = row
        if children == 0 or first_start is None:
            raise BenchError(f"the map {header} of run {run_id} has no started children")
        return {
            "header_state": state,
            "map_total": total,
            "children": int(children),
            "children_succeeded": int(succeeded),
            "source_finished_at": source_done.isoformat(),
            "first_child_started_at": first_start.isoformat(),
            "first_child_after_source_s": (first_start - source_done).total_seconds(),
            "source_to_last_child_s": (last_done - source_done).total_seconds(),
            "db_span_s": float(span),
        }

    def bench_maps(self) -> None:
        """The map scenarios on the bench worker (``--maps``): map N against the static fan-out
        of the same shape, the chained map, and the big map with the worker's memory sampled."""
        if self.args.map_n > 0:
            self.bench_map()
        if self.args.chained_n > 0:
            self.bench_chained_map()
        if not self.args.no_map_big:
            self.bench_map_big()

    def bench_map(self) -> None:
        """1 -> N -> 1 through ``dag.map`` over the source's result against the same DAG written
        out statically (the same source, N ``bench.map_item`` nodes, the same sink), in this run;
        middle tasks/s over submit -> run final, as the fan-out, each the mean of two runs in the
        order static, map, map, static."""
        n = self.args.map_n
        timeout = self.map_timeout(n)
        # static, map, map, static: each side runs once early and once late, so the growth of
        # the tables (ledger, task rows) over the sitting does not favour the side run first
        statics: list[float] = []
        maps: list[float] = []
        run = None
        for i, kind in enumerate(("static", "map", "map", "static")):
            if kind == "static":
                _, took = self.run_dag(static_map_dag(n, f"bench_map_static{i}"), timeout=timeout)
                statics.append(took)
                log(f"static fan-out 1->{n}->1 (bench.map_item): {took:.3f}s = {n / took:.1f} middle tasks/s")
            else:
                run, took = self.run_dag(map_dag(n, f"bench_map{i}"), timeout=timeout)
                maps.append(took)
                log(f"map 1->{n}->1 (dag.map): {took:.3f}s = {n / took:.1f} middle tasks/s")
        assert run is not None
        static_s, map_s = sum(statics) / 2, sum(maps) / 2
        figures = self.map_figures(run.id, "m")
        if figures["children_succeeded"] != n:
            raise BenchError(f"the map of {n} ran {figures['children_succeeded']} children")
        raw = self.results["raw"]["tasks_per_s"]
        self.results["map"] = {
            "run_id": run.id,
            "items": n,
            "elapsed_s": map_s,
            "tasks_per_s": n / map_s,
            "static_elapsed_s": static_s,
            "static_tasks_per_s": n / static_s,
            "runs_s": {"static": statics, "map": maps},
            "ratio_to_static": static_s / map_s,
            "ratio_to_raw": n / map_s / raw,
            **figures,
        }
        log(
            f"map 1->{n}->1: {map_s:.3f}s = {n / map_s:.1f} middle tasks/s ({static_s / map_s:.2f}x static);"
            f" first child started {figures['first_child_after_source_s'] * 1000:.0f} ms after the source"
        )

    def bench_map_big(self) -> None:
        """1 -> --map-big-n -> 1 through ``dag.map`` to the end, the worker's process group's
        memory sampled from /proc all along, against the same shape written out statically in this
        sitting (static first: the later of two runs is the slower one). While the map runs, a
        2-task run of the same tenant is submitted once 5 % of the children are done: its latency
        (submit -> final) says whether it waited behind the map's READY backlog. The map's rate over
        10-second windows (children finished per window, from the database) gives its lowest
        window against its mean (a pause while the next window of children is inserted)."""
        n = self.args.map_big_n
        proc = self.worker.proc
        if proc is None:
            raise BenchError("no worker for the big map")
        timeout = self.map_timeout(n)
        # the static DAG's source and sink count in ORCHESTRATOR_MAX_NODES (100,000 by default): at
        # the cap it has two middle tasks fewer, and the two are compared by their rates
        width = min(n, self.orchestrator().settings.limits.max_nodes - 2)
        # the bench server runs with autovacuum off: each run starts on tables rewritten by VACUUM
        # FULL, and the static run's rows are removed before the map's, so that neither run pays for
        # the dead and live rows of the other (the map used to pay for the static run's: 0.72-0.75x)
        self.vacuum(full=True)
        with TreeMemory(proc.pid):  # the same sampling in both runs
            static_run, static_s = self.run_dag(static_map_dag(width, "bench_map_big_static"), timeout=timeout)
        static_rate = width / static_s
        log(f"static fan-out 1->{width}->1: {static_s:.3f}s = {static_rate:.1f} middle tasks/s")
        self.remove_run(static_run.id)
        self.vacuum(full=True)
        sampler = TreeMemory(proc.pid)
        before = sampler.sample()
        small: dict[str, Any] = {}
        watcher = threading.Thread(target=self.small_run_behind, args=(n, small), daemon=True)
        with sampler:
            watcher.start()
            run, elapsed = self.run_dag(map_dag(n, "bench_map_big"), timeout=timeout)
        watcher.join(timeout=60)
        figures = self.map_figures(run.id, "m")
        if figures["children_succeeded"] != n:
            raise BenchError(f"the map of {n} ran {figures['children_succeeded']} children")
        windows = self.rate_windows(run.id, "m")
        hwm = sampler.high_water_kb()
        self.results["map_big"] = {
            "run_id": run.id,
            "items": n,
            "elapsed_s": elapsed,
            "tasks_per_s": n / elapsed,
            "static_run_id": static_run.id,
            "static_width": width,
            "static_elapsed_s": static_s,
            "static_tasks_per_s": static_rate,
            "ratio_to_static": n / elapsed / static_rate,
            "rate_windows": windows,
            "small_run": small,
            "worker_main_pid": proc.pid,
            "worker_processes": len(before),
            "rss_before_mb": {str(pid): kb / 1024.0 for pid, kb in before.items()},
            "memory": sampler.figures(),
            "lifetime_peak_rss_mb": {str(pid): kb / 1024.0 for pid, kb in hwm.items()},
            **figures,
        }
        mem = sampler.figures()
        log(
            f"map 1->{n}->1: {elapsed:.3f}s = {n / elapsed:.1f} middle tasks/s"
            f" ({n / elapsed / static_rate:.2f}x static);"
            f" 10 s windows: lowest {windows['lowest_per_s']:.1f}/s against a mean of {windows['mean_per_s']:.1f}/s"
            f" ({windows['lowest_to_mean']:.2f}); a 2-task run behind it: {small.get('latency_s', float('nan')):.2f}s;"
            f" worker peak RSS {mem['peak_process_mb']:.0f} MB (largest process; group RSS"
            f" {mem['peak_rss_sum_mb']:.0f} MB, PSS {mem['peak_pss_sum_mb']:.0f} MB); first child started"
            f" {figures['first_child_after_source_s'] * 1000:.0f} ms after the source"
        )

    def small_run_behind(self, n: int, out: dict[str, Any]) -> None:
        """Once 5 % of the big map's children are done, submit a 2-task run of the same tenant and
        wait for it; ``out`` gets its latency (submit -> final) and how many children were done
        then and at its end."""
        import sqlalchemy as sa

        from orchestrator.core.dag import DAG

        orc = self.orchestrator()
        count = sa.text(
            "select count(*) from orc_tasks t join orc_runs r on r.id = t.run_id"
            " where r.dag_name = 'bench_map_big' and t.map_parent = 'm' and t.state = 'SUCCEEDED'"
        )
        deadline = time.monotonic() + self.map_timeout(n)
        try:
            done = 0
            while time.monotonic() < deadline:
                with orc.store.engine.connect() as conn:
                    done = int(conn.execute(count).scalar_one())
                if done >= n // 20:
                    break
                time.sleep(0.2)
            dag = DAG("bench_small_behind_map")
            first = dag.task("a", NOOP)
            dag.task("b", NOOP, upstream=[first])
            t0 = time.perf_counter()
            run = orc.submit(dag)
            view = run.wait(self.map_timeout(n), poll=0.01)
            out["latency_s"] = time.perf_counter() - t0
            out["state"] = view.state.value
            with orc.store.engine.connect() as conn:
                out["children_done_at_submit"] = done
                out["children_done_at_end"] = int(conn.execute(count).scalar_one())
        except Exception as exc:  # noqa: BLE001 (the figure is missing; the bench goes on)
            out["error"] = repr(exc)

    def rate_windows(self, run_id: str, header: str, width: float = 10.0) -> dict[str, Any]:
        """Children of the map ``header`` finished per ``width``-second window, from its first
        child's start to its last child's end (the last, partial window left out): the mean rate,
        the lowest window's and their ratio (the issue's bar: at least 0.5)."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "with c as (select finished_at, started_at from orc_tasks where run_id = :r and map_parent = :h)"
                    " select floor(extract(epoch from c.finished_at - (select min(started_at) from c)) / :w)::int,"
                    " count(*) from c group by 1 order by 1"
                ),
                {"r": run_id, "h": header, "w": width},
            ).all()
            span = conn.execute(
                sa.text(
                    "select extract(epoch from max(finished_at) - min(started_at)) from orc_tasks"
                    " where run_id = :r and map_parent = :h"
                ),
                {"r": run_id, "h": header},
            ).scalar_one()
        counts = dict(rows)
        last = max(counts) if counts else 0
        full = [counts.get(i, 0) / width for i in range(last)]  # the last window is partial
        total = sum(counts.values())
        mean = total / float(span) if span else 0.0
        lowest = min(full) if full else mean
        return {
            "width_s": width,
            "per_window": [counts.get(i, 0) for i in range(last + 1)],
            "mean_per_s": mean,
            "lowest_per_s": lowest,
            "lowest_to_mean": lowest / mean if mean else 0.0,
        }

    def bench_chained_map(self) -> None:
        """source -> s1 -> s2 -> s3 (each a map over the one before, item by item) -> sink over
        --chained-n items: depth first when item 0's last stage starts before item N-1's first
        stage has finished."""
        import sqlalchemy as sa

        n, depth = self.args.chained_n, CHAINED_DEPTH
        last = f"s{depth}"
        run, elapsed = self.run_dag(chained_map_dag(n, "bench_chained_map"), timeout=self.map_timeout(n * depth))
        with self.orchestrator().store.engine.connect() as conn:
            first_last, last_first, source_done = conn.execute(
                sa.text(
                    "select (select started_at from orc_tasks where run_id = :r and map_parent = :z and map_index = 0),"
                    " (select finished_at from orc_tasks where run_id = :r and map_parent = 's1'"
                    "   and map_index = :n - 1),"
                    " (select finished_at from orc_tasks where run_id = :r and key = 'source')"
                ),
                {"r": run.id, "z": last, "n": n},
            ).one()
            if first_last is None or last_first is None:
                raise BenchError(f"chained map run {run.id}: the stage tasks are missing")
            # how much of the first stage was still to finish when item 0's last stage started
            pending = conn.execute(
                sa.text(
                    "select count(*) from orc_tasks where run_id = :r and map_parent = 's1'"
                    " and (finished_at is null or finished_at > :t)"
                ),
                {"r": run.id, "t": first_last},
            ).scalar_one()
        depth_first = first_last < last_first
        self.results["chained_map"] = {
            "run_id": run.id,
            "items": n,
            "depth": depth,
            "tasks": n * depth + 2,
            "elapsed_s": elapsed,
            "tasks_per_s": n * depth / elapsed,
            "first_item_last_stage_started_at": first_last.isoformat(),
            "last_item_first_stage_finished_at": last_first.isoformat(),
            "first_item_last_stage_started_after_source_s": (first_last - source_done).total_seconds(),
            "last_item_first_stage_finished_after_source_s": (last_first - source_done).total_seconds(),
            "first_stage_unfinished_then": int(pending),
            "depth_first": depth_first,
        }
        log(
            f"chained map {depth} x {n}: {elapsed:.3f}s; {last}[0] started"
            f" {(first_last - source_done).total_seconds():.3f}s and s1[{n - 1}] finished"
            f" {(last_first - source_done).total_seconds():.3f}s after the source: depth first {depth_first}"
        )

    def map_expand_probe(self, url: str, sizes: list[int], repeat: int = 3) -> None:
        """The commit time of a map's expansion, measured directly: in its own database with no
        worker, a fake worker registered on the unconsumed queue (so admission runs as on the
        bench worker), a new ``map_dag`` run per measurement; this process claims its source and
        times the source's success (``orc_succeed_v2``: one autocommit statement that records the
        success, expands the map into its N children with their ledger rows, settles, admits, and
        commits), client side, with ``bench.listing``'s N items as the result; each run is then
        cancelled. ``repeat`` timed runs per size, then one more with ``track_functions = 'pl'``
        (superuser only) for the server's split: ``orc_expand_v1`` and ``orc_map_insert_v1``."""
        import sqlalchemy as sa

        from orchestrator.core.config import Settings
        from orchestrator.core.publisher import RecordingPublisher
        from orchestrator.engine.facade import Orchestrator

        name = sa.engine.make_url(url).database
        orc = Orchestrator(Settings.from_env(database_url=url), app=self.app, publisher=RecordingPublisher())
        store = orc.store
        worker = "orc-bench-map-probe"
        window = orc.settings.dispatch_window

        def track(on: bool) -> bool:
            """Function statistics for the sessions opened from now on (the hot path's is closed)."""
            store.attempts.hot.close()
            value = "'pl'" if on else "DEFAULT"
            try:
                with store.engine.connect() as conn:
                    conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET track_functions = {value}')
                    if on:
                        conn.execute(sa.text("select pg_stat_reset()"))
                    conn.commit()
            except sa.exc.DBAPIError:
                return False  # not a superuser: no server-side split
            return True

        def measure(n: int) -> float:
            store.workers.register(worker, [UNCONSUMED_QUEUE], self.args.concurrency)
            run = orc.submit(map_dag(n, f"bench_map_probe_{n}", queue=UNCONSUMED_QUEUE))
            source = orc.task(run.id, "source")
            if source.state.value != "QUEUED":
                raise BenchError(f"map probe: the source is {source.state.value}, not QUEUED")
            if store.attempts.claim(run.id, "source", source.attempt, f"{worker}:1", 60.0, LISTING) is None:
                raise BenchError("map probe: the source's claim was refused")
            items = list(range(n))
            t0 = time.perf_counter()
            out = store.attempts.succeed(run.id, "source", source.attempt, items, window)
            took = time.perf_counter() - t0
            header = orc.task(run.id, "m")
            if not out.accepted or header.state.value != "MAPPED":
                raise BenchError(f"map probe: the source's success gave {out} and a {header.state.value} map")
            orc.cancel(run.id)  # its admitted children would hold the fake worker's window
            return took

        figures: dict[str, Any] = {}
        try:
            measure(10)  # warm-up: connections, prepared statements, the task registry
            for n in sizes:
                times = []
                for i in range(repeat):
                    times.append(measure(n))
                    log(f"map probe: expansion of {n} items, source's success {times[-1] * 1000:.1f} ms (#{i + 1})")
                entry: dict[str, Any] = {
                    "items": n,
                    "runs_s": times,
                    "median_s": statistics.median(times),
                    "max_s": max(times),
                }
                if track(True):
                    entry["tracked_s"] = measure(n)
                    store.attempts.hot.close()  # its backend ends: its function statistics are flushed
                    time.sleep(0.6)
                    with store.engine.connect() as conn:
                        conn.execute(sa.text("select pg_stat_clear_snapshot()"))
                        stats = conn.execute(
                            sa.text(
                                "select funcname, calls, total_time from pg_stat_user_functions"
                                " where funcname in ('orc_succeed_v2', 'orc_expand_v1', 'orc_map_insert_v1')"
                            )
                        ).all()
                    track(False)
                    entry["server_ms"] = {str(f): float(t) / max(int(c), 1) for f, c, t in stats}
                figures[str(n)] = entry
        finally:
            store.dispose()
        self.results["map_expand"] = {"repeat": repeat, "sizes": figures}

    # -------------------------------------------------------------- Celery canvas reference

    def bench_canvas(self, worker: Worker) -> None:
        """A Celery chord 1 -> N -> 1 and a canvas chain of the chain's length, on a second
        worker with the same settings and a Redis result backend (``bench/canvas_app.py``)."""
        from celery import chain, chord, group

        from bench.canvas_app import DONE_KEY, app, noop
        from bench.canvas_app import done as done_task

        n, links = self.args.fanout, self.args.chain
        worker.start()
        try:
            # warm-up: the worker is up and its pool processes have imported the tasks
            self.redis.delete(DONE_KEY)
            chord(group(noop.si() for _ in range(4)), done_task.si()).apply_async()
            wait_until(lambda: int(self.redis.get(DONE_KEY) or 0) >= 1, self.args.timeout, "canvas warm-up", worker)

            self.redis.delete(DONE_KEY)
            t0 = time.perf_counter()
            chain(noop.si(), chord(group(noop.si() for _ in range(n)), done_task.si())).apply_async()
            t_done = wait_until(
                lambda: int(self.redis.get(DONE_KEY) or 0) >= 1, self.args.timeout, f"a chord of {n}", worker
            )
            chord_s = t_done - t0

            self.redis.delete(DONE_KEY)
            t0 = time.perf_counter()
            chain(*[noop.si() for _ in range(links - 1)], done_task.si()).apply_async()
            t_done = wait_until(
                lambda: int(self.redis.get(DONE_KEY) or 0) >= 1, self.args.timeout, f"a canvas chain of {links}", worker
            )
            chain_s = t_done - t0
        finally:
            worker.stop()
            with contextlib.suppress(Exception):
                app.close()
        self.results["chord"] = {"middle_tasks": n, "elapsed_s": chord_s, "tasks_per_s": n / chord_s}
        self.results["canvas_chain"] = {"tasks": links, "elapsed_s": chain_s, "step_ms": chain_s / links * 1000.0}
        log(f"Celery chord 1->{n}->1: {chord_s:.3f}s = {n / chord_s:.1f} middle tasks/s")
        log(f"Celery canvas chain {links}: {chain_s:.3f}s = {chain_s / links * 1000:.2f} ms per link")

    def backend_cpu(self) -> dict[int, float]:
        """CPU seconds (``/proc``) of each server process connected to the bench database (this
        process's own session left out): the worker's pooled sessions live through a run, so the
        difference over the run is the server's CPU for it, whatever else runs on the machine."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            pids = conn.execute(
                sa.text(
                    "select pid from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()"
                )
            ).scalars()
            out: dict[int, float] = {}
            for pid in pids:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return out

    def transactions(self) -> int:
        """Committed + rolled back transactions of the bench database so far (the server's
        statistics; the hot path runs each call as one autocommit statement)."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            conn.execute(sa.text("select pg_stat_clear_snapshot()"))
            return int(
                conn.execute(
                    sa.text(
                        "select xact_commit + xact_rollback from pg_stat_database where datname = current_database()"
                    )
                ).scalar_one()
            )

    # -------------------------------------------------------------- 4. parent -> child latency

    def bench_latency(self) -> None:
        import sqlalchemy as sa

        run_id = self.results["chain"]["run_id"]
        with self.orchestrator().store.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "select extract(epoch from c.started_at - p.finished_at) * 1000"
                    " from orc_edges e"
                    " join orc_tasks p on p.run_id = e.run_id and p.key = e.parent_key"
                    " join orc_tasks c on c.run_id = e.run_id and c.key = e.child_key"
                    " where e.run_id = :r"
                ),
                {"r": run_id},
            ).all()
        values = [float(v) for (v,) in rows]
        if not values:
            raise BenchError("the chain run has no edges to measure")
        self.results["latency"] = {"run": "chain", **summary_ms(values)}
        s = self.results["latency"]
        log(f"parent->child over {s['n']} edges: p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms")

    # -------------------------------------------------------------- 5. fairness and priority

    def _share(self, since_id: int, until_id: int) -> dict[str, int]:
        """Admissions (READY -> QUEUED) per tenant between two event ids."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "select t.tenant, count(*) from orc_task_events e"
                    " join orc_tasks t on t.run_id = e.run_id and t.key = e.key"
                    " where e.id > :a and e.id <= :b and e.to_state = 'QUEUED' and e.accepted group by t.tenant"
                ),
                {"a": since_id, "b": until_id},
            ).all()
        return {str(k): int(n) for k, n in found}

    def _last_event_id(self, run_id: str | None = None, to_state: str | None = None) -> int:
        import sqlalchemy as sa

        q = "select coalesce(max(id), 0) from orc_task_events where true"
        params: dict[str, Any] = {}
        if run_id:
            q += " and run_id = :r"
            params["r"] = run_id
        if to_state:
            q += " and to_state = :s"
            params["s"] = to_state
        with self.orchestrator().store.engine.connect() as conn:
            return int(conn.execute(sa.text(q), params).scalar_one())

    def _tenant_run(self, tenant: str, n: int, name: str, priority: str = "default") -> Any:
        from orchestrator.core.dag import DAG

        dag = DAG(name, tenant=tenant, priority=priority)
        for i in range(n):
            dag.task(f"t{i:05d}", NOOP)
        return dag

    def bench_fairness(self) -> None:
        """Tenant A's backlog of --fairness-tasks low no-ops, then tenant B's 20-task run one
        second later: B's completion against B alone on the idle worker, and the A:B share of the
        admissions while both had READY work, for equal weights and for weights 3:1; and a high
        task submitted behind A's low backlog: submit -> start."""
        n = self.args.fairness_tasks
        if n <= 0:
            return
        orc = self.orchestrator()
        orc.tenants.set_weight("bench-a", 1)
        orc.tenants.set_weight("bench-b", 1)
        t0 = time.perf_counter()
        alone = orc.submit(self._tenant_run("bench-b", 20, "b-alone"))
        alone.wait(self.args.timeout, poll=0.005)
        b_alone = time.perf_counter() - t0
        backlog = orc.submit(self._tenant_run("bench-a", n, "a-backlog", priority="low"))
        time.sleep(1.0)
        figures: dict[str, Any] = {"backlog": n, "b_alone_s": b_alone}
        for label, weights in (("equal", (1, 1)), ("3:1", (3, 1))):
            orc.tenants.set_weight("bench-a", weights[0])
            orc.tenants.set_weight("bench-b", weights[1])
            since = self._last_event_id()
            t0 = time.perf_counter()
            b = orc.submit(self._tenant_run("bench-b", 20, f"b-{label}", priority="low"))
            b.wait(self.args.timeout, poll=0.005)
            elapsed = time.perf_counter() - t0
            until = self._last_event_id(b.id, "QUEUED")
            share = self._share(since, until)
            ratio = share.get("bench-a", 0) / max(share.get("bench-b", 0), 1)
            figures[label] = {"b_s": elapsed, "b_vs_alone": elapsed / b_alone, "share": share, "a_to_b": ratio}
            log(
                f"fairness {label}: B's 20 tasks in {elapsed:.3f}s ({elapsed / b_alone:.2f}x alone),"
                f" admissions A:B {share.get('bench-a', 0)}:{share.get('bench-b', 0)} = {ratio:.2f}"
            )
        t0 = time.perf_counter()
        high = orc.submit(self._tenant_run("bench-b", 1, "high-behind-low", priority="high"))
        import sqlalchemy as sa

        while True:
            with orc.store.engine.connect() as conn:
                started = conn.execute(
                    sa.text("select started_at is not null from orc_tasks where run_id = :r"), {"r": high.id}
                ).scalar_one()
            if started:
                break
            if time.perf_counter() - t0 > self.args.timeout:
                raise BenchError("the high task never started")
            time.sleep(0.002)
        figures["high_start_s"] = time.perf_counter() - t0
        log(f"a high task behind {n} low ones started {figures['high_start_s'] * 1000:.0f} ms after its submit")
        orc.cancel(backlog.id)
        self.results["fairness"] = figures

    # -------------------------------------------------------------- 6. limits

    def _db_now(self) -> Any:
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            return conn.execute(sa.text("select clock_timestamp()")).scalar_one()

    def _most_at_once(self, run_id: str, states: set[str]) -> int:
        """The most tasks of the run in ``states`` at once, replaying its accepted transitions."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            found = conn.execute(
                sa.text(
                    "select from_state, to_state from orc_task_events where run_id = :r and key is not null"
                    " and accepted order by at, id"
                ),
                {"r": run_id},
            ).all()
        now = most = 0
        for src, dst in found:
            now += (dst in states) - (src in states)
            most = max(most, now)
        return most

    def _first_claim(self, run_id: str, after: Any, worker: str) -> Any:
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            return conn.execute(
                sa.text(
                    "select min(at) from orc_task_events where run_id = :r and to_state = 'RUNNING' and accepted"
                    " and at > :t and reason like :w"
                ),
                {"r": run_id, "t": after, "w": f"claim by {worker}%"},
            ).scalar()

    def bench_pool(self) -> None:
        """A pool of 2 slots under 50 no-op tasks on the bench worker: the most of its tasks
        running (and QUEUED or RUNNING) at once, from the ledger (must be 2)."""
        from orchestrator.core.dag import DAG

        orc = self.orchestrator()
        orc.limits.set_pool("bench-pool", 2)
        dag = DAG("pooled")
        for i in range(50):
            dag.task(f"p{i:02d}", NOOP, pool="bench-pool")
        run, elapsed = self.run_dag(dag, analyze=False)
        run_id = run.id
        self.results["limits"] = {
            "pool_tasks": 50,
            "pool_slots": 2,
            "pool_elapsed_s": elapsed,
            "pool_most_running": self._most_at_once(run_id, {"RUNNING"}),
            "pool_most_in_flight": self._most_at_once(run_id, {"QUEUED", "RUNNING"}),
        }
        log(f"pool of 2 under 50 tasks: at most {self.results['limits']['pool_most_running']} running at once")

    def bench_slot_recovery(self, make_worker: Callable[[str], Worker]) -> None:
        """Pool slots after a kill -9 and after a cancel, with two fresh workers whose leases are
        --lease seconds: worker 1 holds both slots of a 2-slot pool and is killed with -9; the
        seconds until worker 2 claims a pool task (target: lease + one tick). Then a run holding
        the pool is cancelled: how soon its slot is admitted to, and claimed by, a waiting run."""
        from orchestrator.core.dag import DAG

        orc = self.orchestrator()
        orc.limits.set_pool("bench-held", 2)
        first, second = make_worker("-held"), make_worker("-spare")
        first.start()
        try:
            self._wait_workers(1)
            dag = DAG("held")
            for i in range(4):
                dag.task(f"h{i}", "tasks.probes.sleep", kwargs={"seconds": 2 * self.args.lease}, pool="bench-held",
                         max_attempts=3)  # fmt: skip
            held = orc.submit(dag)
            wait_until(lambda: self._running(held.id) == 2, self.args.timeout, "both pool slots running", first)
            second.start()
            self._wait_workers(2)
            killed_at = self._db_now()
            first.kill()
            wait_until(
                lambda: self._first_claim(held.id, killed_at, f"orc-bench-celery_app-{os.getpid()}-spare") is not None,
                self.args.timeout, "the spare worker to claim a pool task", second,
            )  # fmt: skip
            back = self._first_claim(held.id, killed_at, f"orc-bench-celery_app-{os.getpid()}-spare") - killed_at
            orc.cancel(held.id)
            # a run holding the only slot of a pool, cancelled while another run waits for it
            orc.limits.set_pool("bench-one", 1)
            holder = DAG("holder")
            holder.task("long", "tasks.probes.sleep", kwargs={"seconds": 60.0}, pool="bench-one")
            a = orc.submit(holder)
            wait_until(lambda: self._running(a.id) == 1, self.args.timeout, "the holder running", second)
            waiter = DAG("waiter")
            waiter.task("next", NOOP, pool="bench-one")
            b = orc.submit(waiter)
            time.sleep(0.2)
            orc.cancel(a.id)
            b.wait(self.args.timeout, poll=0.002)
            import sqlalchemy as sa

            with orc.store.engine.connect() as conn:
                cancelled = conn.execute(
                    sa.text(
                        "select at from orc_task_events where run_id = :r and key is null and to_state = 'CANCELLED'"
                    ),
                    {"r": a.id},
                ).scalar_one()
                queued, claimed = conn.execute(
                    sa.text(
                        "select min(at) filter (where to_state = 'QUEUED'), min(at) filter (where to_state = 'RUNNING')"
                        " from orc_task_events where run_id = :r and key is not null and accepted"
                    ),
                    {"r": b.id},
                ).one()
        finally:
            first.stop()
            second.stop()
        self.results.setdefault("limits", {}).update(
            {
                "lease_s": self.args.lease,
                "tick_s": 1.0,
                "kill_slots_back_s": back.total_seconds(),
                "cancel_admitted_ms": (queued - cancelled).total_seconds() * 1000,
                "cancel_claimed_ms": (claimed - cancelled).total_seconds() * 1000,
            }
        )
        log(
            f"slots back {back.total_seconds():.2f}s after kill -9 (lease {self.args.lease:g}s);"
            f" after a cancel: admitted {(queued - cancelled).total_seconds() * 1000:.0f} ms,"
            f" claimed {(claimed - cancelled).total_seconds() * 1000:.0f} ms"
        )

    def _running(self, run_id: str) -> int:
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("select count(*) from orc_tasks where run_id = :r and state = 'RUNNING'"), {"r": run_id}
                ).scalar_one()
            )

    def _wait_workers(self, n: int) -> None:
        import sqlalchemy as sa

        def live() -> bool:
            with self.orchestrator().store.engine.connect() as conn:
                found = conn.execute(
                    sa.text("select count(*) from orc_workers where seen_at > now() - interval '3 seconds'")
                ).scalar_one()
            return int(found) >= n

        deadline = time.monotonic() + self.args.timeout
        while not live():
            if time.monotonic() > deadline:
                raise BenchError(f"{n} live workers never registered")
            time.sleep(0.05)

    # -------------------------------------------------------------- 3. submit

    def submit_dag(self, n: int, name: str) -> Any:
        from orchestrator.core.dag import DAG

        dag = DAG(name)
        root = dag.task("root", NOOP, queue=UNCONSUMED_QUEUE)
        for i in range(n - 1):
            dag.task(f"n{i:05d}", NOOP, upstream=[root], queue=UNCONSUMED_QUEUE)
        return dag

    def bench_submit(self, submit_url: str) -> None:
        from orchestrator.core.config import Settings
        from orchestrator.engine.facade import Orchestrator

        n = self.args.submit_nodes
        orc = Orchestrator(Settings.from_env(database_url=submit_url), app=self.app)
        # warm up: connection pool, compiled statements, task registry
        orc.submit(self.submit_dag(3, "bench_submit_warmup"))
        t0 = time.perf_counter()
        self.submit_dag(n, "bench_submit")
        build_s = time.perf_counter() - t0
        times = []
        for i in range(self.args.submit_repeat):
            dag = self.submit_dag(n, "bench_submit")
            t0 = time.perf_counter()
            orc.submit(dag)
            times.append(time.perf_counter() - t0)
            log(f"submit {n} nodes #{i + 1}: {times[-1]:.3f}s")
        breakdown = self.submit_breakdown(orc, n)
        self.results["submit"] = {
            "nodes": n,
            "edges": n - 1,
            "shape": f"1 root -> {n - 1} children",
            "dag_build_s": build_s,
            "runs_s": times,
            "median_s": statistics.median(times),
            "min_s": min(times),
            "breakdown": breakdown,
        }
        if self.args.profile_submit:
            self.results["submit"]["profile"] = self.profile_submit(orc, n)
        orc.store.dispose()

    def submit_breakdown(self, orc: Any, n: int) -> dict[str, Any]:
        """One more submit with its steps timed (instance-level wrappers, engine code unchanged)
        and every DB round trip counted and timed (SQLAlchemy cursor events)."""
        import sqlalchemy as sa

        dag = self.submit_dag(n, "bench_submit")
        acc: dict[str, list[float]] = {}

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    slot = acc.setdefault(name, [0.0, 0])
                    slot[0] += time.perf_counter() - t
                    slot[1] += 1

            return wrapper

        starts: dict[int, float] = {}
        sql: dict[str, list[float]] = {}

        def before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
            starts[id(cursor)] = time.perf_counter()

        def after(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
            took = time.perf_counter() - starts.pop(id(cursor), time.perf_counter())
            head = " ".join(statement.split()[:3])[:40]
            slot = sql.setdefault(head, [0.0, 0])
            slot[0] += took
            slot[1] += 1

        store = orc.store
        dialect = store.engine.dialect
        targets = [
            (dag, "validate", "dag.validate"),
            (orc, "_check_time_limits", "check_time_limits"),
            (orc.registry, "wants_upstream", "wants_upstream (per task name)"),
            (store.submission, "create_run", "store.submission.create_run (one transaction)"),
            (store.admission, "admit_ready", "store.admission.admit_ready"),
            (orc.publisher, "publish", "publish"),
            (dialect, "do_commit", "COMMIT"),
            (dialect, "do_ping", "pool pre-ping (SELECT 1)"),
        ]
        # instance attributes shadow the methods for this one submit; names that the engine
        # no longer has are skipped, so the breakdown degrades instead of failing
        patched = {(obj, attr): timed(label, getattr(obj, attr)) for obj, attr, label in targets if hasattr(obj, attr)}
        for (obj, attr), fn in patched.items():
            setattr(obj, attr, fn)
        sa.event.listen(store.engine, "before_cursor_execute", before)
        sa.event.listen(store.engine, "after_cursor_execute", after)
        try:
            t0 = time.perf_counter()
            orc.submit(dag)
            total = time.perf_counter() - t0
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", before)
            sa.event.remove(store.engine, "after_cursor_execute", after)
            for obj, attr in patched:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        steps = {k: {"s": v[0], "calls": int(v[1])} for k, v in acc.items()}
        return {
            "total_s": total,
            "steps": steps,
            "sql": {k: {"s": v[0], "calls": int(v[1])} for k, v in sorted(sql.items(), key=lambda kv: -kv[1][0])},
            "sql_total_s": sum(v[0] for v in sql.values()),
        }

    def profile_submit(self, orc: Any, n: int) -> str:
        dag = self.submit_dag(n, "bench_submit")
        prof = cProfile.Profile()
        prof.enable()
        orc.submit(dag)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        return out.getvalue()

    # -------------------------------------------------------------- planner probe

    def planner_probe(self, probe_url: str) -> None:
        """Time the store's settlement (what a finishing task runs to count itself into its
        children) for one middle task of a new fan-out run, in a transaction rolled back:
        first while the planner's statistics only know an earlier small run (a young
        deployment, or any run submitted since the last analyze), then after ANALYZE.

        Runs in its own database on the unconsumed queue, with no worker: nothing executes.
        """
        import sqlalchemy as sa

        from orchestrator.core.config import Settings
        from orchestrator.core.states import TaskState
        from orchestrator.engine.facade import Orchestrator
        from orchestrator.store.schema import tasks

        n = self.args.planner_probe
        orc = Orchestrator(Settings.from_env(database_url=probe_url), app=self.app)
        store = orc.store
        from orchestrator.core.models import WORKER

        def settle(conn: Any, run_id: str, finished: list[Any]) -> None:
            store.settlement.settle(conn, run_id, finished, WORKER)

        orc.submit(fanout_dag(10, "bench_planner_probe_small", queue=UNCONSUMED_QUEUE))
        self.analyze(store.engine)  # statistics of the small run only, not of the probe's
        run = orc.submit(fanout_dag(n, "bench_planner_probe", queue=UNCONSUMED_QUEUE))

        def settle_ms() -> float:
            times = []
            for i in range(5):
                key = f"m{(i * 397) % n:05d}"
                with store.engine.connect() as conn:
                    tx = conn.begin()
                    children = conn.execute(
                        sa.select(tasks.c.children).where(tasks.c.run_id == run.id, tasks.c.key == key)
                    ).scalar_one()
                    t0 = time.perf_counter()
                    settle(conn, run.id, [(key, TaskState.SUCCEEDED, children)])
                    times.append((time.perf_counter() - t0) * 1000.0)
                    tx.rollback()
            return statistics.median(times)

        stale = settle_ms()
        self.analyze(store.engine)
        fresh = settle_ms()
        orc.store.dispose()
        self.results["planner_probe"] = {"fanout": n, "tasks": n + 2, "stale_ms": stale, "analyzed_ms": fresh}
        log(f"planner probe: settle in a new {n + 2}-task run {stale:.1f} ms, {fresh:.2f} ms after ANALYZE")

    # -------------------------------------------------------------- warm-up

    def warm_up(self) -> None:
        from orchestrator.core.dag import DAG

        c = self.args.concurrency
        self.send_raw(20 * c)
        dag = DAG("bench_warmup")
        root = dag.task("root", NOOP)
        mids = [dag.task(f"m{i}", NOOP, upstream=[root]) for i in range(10 * c)]
        dag.task("sink", NOOP, upstream=mids)
        self.run_dag(dag, analyze=False)
        log("worker warmed up (raw tasks and an orchestrated DAG ran)")
        if self.args.planner_stats != "none":
            self.analyze()

    def vacuum(self, *, full: bool = False) -> None:
        """VACUUM the orc_* tables (as autovacuum would; the bench server runs with it off);
        ``full``: VACUUM FULL, which also gives back the pages of deleted rows (nothing must run).
        No ANALYZE (``--planner-stats`` decides that): with VACUUM FULL ANALYZE on the near-empty
        tables between the two big-map runs, the 100,000-item map ran at ~30 tasks/s, where the
        same map on a fresh database (``bench/cpu_profile.py 100000 --shape map``) ran at 251."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            tables = conn.execute(sa.text("select tablename from pg_tables where tablename like 'orc_%'")).scalars()
            for table in list(tables):
                conn.exec_driver_sql(f'VACUUM {"FULL " if full else ""}"{table}"')

    def remove_run(self, run_id: str) -> None:
        """Delete one finished run's rows (the bench's own database: nothing to archive)."""
        import sqlalchemy as sa

        with self.orchestrator().store.engine.begin() as conn:
            for table in ("orc_task_events", "orc_edges", "orc_progress", "orc_tasks"):
                conn.execute(sa.text(f"delete from {table} where run_id = :r"), {"r": run_id})
            conn.execute(sa.text("delete from orc_runs where id = :r"), {"r": run_id})

    def analyze(self, engine: Any = None) -> None:
        """ANALYZE the orchestrator's tables, as autovacuum's auto-analyze would eventually.

        When the statistics do not know a run (always true of a new run until the next
        analyze), the planner estimates ~1 row per run id and may pick an O(tasks x edges)
        plan for the worker's child-counter UPDATE: see :meth:`planner_probe`.
        """
        import sqlalchemy as sa

        engine = engine if engine is not None else self.orchestrator().store.engine
        with engine.connect() as conn:
            tables = [
                name
                for (name,) in conn.execute(
                    sa.text(
                        "select tablename from pg_tables where schemaname = current_schema() and tablename like 'orc_%'"
                    )
                )
            ]
            for name in tables:
                conn.exec_driver_sql(f'ANALYZE "{name}"')
            conn.commit()


# ---------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def map_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The report's rows of the dynamic-DAG scenarios (issue 19), those that ran."""
    rows: list[tuple[str, str, str, str]] = []
    m = results.get("map")
    if m:
        n = m["items"]
        rows += [
            (f"static fan-out 1->{n:,}->1 (bench.map_item, mean of 2)", f"{m['static_tasks_per_s']:.1f} tasks/s",
             "reference", ""),
            (f"map 1->{n:,}->1 (dag.map over the source's result, mean of 2)", f"{m['tasks_per_s']:.1f} tasks/s",
             "", ""),
            ("  map / static fan-out", f"{m['ratio_to_static']:.3f}x", f">= {TARGET_MAP_RATIO:.2f}x",
             verdict(m["ratio_to_static"] >= TARGET_MAP_RATIO)),
            ("  map / raw Celery", f"{m['ratio_to_raw']:.2f}x", "(info)", ""),
            ("  source succeeded -> first child started (DB clock)",
             f"{m['first_child_after_source_s'] * 1000:.0f} ms", "(info)", ""),
        ]  # fmt: skip
    probe = results.get("map_expand")
    if probe:
        for n, e in probe["sizes"].items():
            rows.append(
                (
                    f"map expansion of {int(n):,} items: source's success + commit"
                    f" (probe, median of {len(e['runs_s'])})",
                    f"{e['median_s'] * 1000:.0f} ms (max {e['max_s'] * 1000:.0f})",
                    # the target is the 10,000-wide expansion's; a 100,000-wide one is judged by
                    # its first child's start (map 1->100,000->1 below)
                    f"<= {TARGET_EXPAND_S * 1000:.0f} ms" if int(n) <= 10_000 else "(info)",
                    verdict(e["median_s"] <= TARGET_EXPAND_S) if int(n) <= 10_000 else "",
                )
            )
            server = e.get("server_ms", {})
            if "orc_expand_v1" in server:
                rows.append(
                    (
                        "  tracked once more: orc_expand_v1 / orc_map_insert_v1 of it",
                        f"{server['orc_expand_v1']:.0f} / {server.get('orc_map_insert_v1', 0.0):.0f} ms"
                        f" of {e['tracked_s'] * 1000:.0f}",
                        "(info)",
                        "",
                    )
                )
    c = results.get("chained_map")
    if c:
        rows += [
            (f"chained map {c['depth']} x {c['items']:,} items", f"{c['tasks_per_s']:.1f} tasks/s", "(info)", ""),
            (f"  s{c['depth']}[0] started before s1[{c['items'] - 1}] finished (after the source)",
             f"{c['first_item_last_stage_started_after_source_s']:.3f} s vs"
             f" {c['last_item_first_stage_finished_after_source_s']:.3f} s",
             "depth first", verdict(c["depth_first"])),
        ]  # fmt: skip
    b = results.get("map_big")
    if b:
        mem = b["memory"]
        rows += [
            (f"map 1->{b['items']:,}->1 to the end", f"{b['elapsed_s']:.1f} s = {b['tasks_per_s']:.1f} tasks/s",
             "completes", verdict(b["children_succeeded"] == b["items"])),
            ("  worker peak RSS, largest process (process group RSS / PSS)",
             f"{mem['peak_process_mb']:.0f} MB ({mem['peak_rss_sum_mb']:.0f} / {mem['peak_pss_sum_mb']:.0f} MB)",
             f"<= {TARGET_MAP_RSS_MB:.0f} MB", verdict(mem["peak_process_mb"] <= TARGET_MAP_RSS_MB)),
            ("  source succeeded -> first child started (DB clock)",
             f"{b['first_child_after_source_s']:.2f} s", f"<= {TARGET_FIRST_CHILD_S:.0f} s",
             verdict(b["first_child_after_source_s"] <= TARGET_FIRST_CHILD_S)),
            (f"  against a static fan-out of {b['items']:,} (same sitting)",
             f"{b['ratio_to_static']:.2f}x ({b['static_tasks_per_s']:.1f} tasks/s static)",
             f">= {TARGET_BIG_MAP_TO_STATIC}x", verdict(b["ratio_to_static"] >= TARGET_BIG_MAP_TO_STATIC)),
            ("  lowest 10 s window against the mean rate",
             f"{b['rate_windows']['lowest_per_s']:.1f} / {b['rate_windows']['mean_per_s']:.1f} tasks/s"
             f" = {b['rate_windows']['lowest_to_mean']:.2f}",
             f">= {TARGET_WINDOW_TO_MEAN}", verdict(b["rate_windows"]["lowest_to_mean"] >= TARGET_WINDOW_TO_MEAN)),
            ("  a 2-task run of the same tenant behind it: submit -> final",
             f"{b['small_run'].get('latency_s', float('nan')):.2f} s",
             f"<= {TARGET_SMALL_BEHIND_MAP_S:.0f} s",
             verdict(b["small_run"].get("latency_s", float("inf")) <= TARGET_SMALL_BEHIND_MAP_S)),
        ]  # fmt: skip
    return rows


def map_details(results: dict[str, Any]) -> list[str]:
    """The report's detail lines of the dynamic-DAG scenarios that ran."""
    lines = []
    m = results.get("map")
    if m:
        lines.append(
            f"  map {m['items']}: submit -> run final {m['elapsed_s']:.3f}s wall ({m['db_span_s']:.3f}s DB clock),"
            f" static {m['static_elapsed_s']:.3f}s; source finished {m['source_finished_at']}, first child"
            f" started {m['first_child_started_at']}"
        )
    if "map_expand" in results:
        lines.append(
            "  map expansion probe: own database, no worker (a fake one registered on an unconsumed queue),"
            " a new 1 -> map -> 1 run each time; the source's orc_succeed_v2 call timed in this process"
            " (result sent, expansion, ledger rows, settle, admit, commit)"
        )
    c = results.get("chained_map")
    if c:
        lines.append(
            f"  chained map: s{c['depth']}[0] started {c['first_item_last_stage_started_at']}, s1[{c['items'] - 1}]"
            f" finished {c['last_item_first_stage_finished_at']}; {c['first_stage_unfinished_then']} of s1's"
            f" {c['items']} children had not finished then"
        )
    b = results.get("map_big")
    if b:
        main = str(b["worker_main_pid"])

        def per_pid(mb: dict[str, float]) -> str:
            return ", ".join(f"{v:.0f}" + (" (main)" if pid == main else "") for pid, v in mb.items())

        before, life = per_pid(b["rss_before_mb"]), per_pid(b["lifetime_peak_rss_mb"])
        mem = b["memory"]
        lines.append(
            f"  map {b['items']}: worker processes' RSS before the run {before} MB; peak"
            f" {mem['peak_process_mb']:.0f} MB in the {'main process' if mem['peak_process_is_main'] else 'pool'}"
            f" ({mem['samples']} samples every {mem['interval_s']:g}s); lifetime peaks (VmHWM) {life} MB;"
            f" source finished {b['source_finished_at']}, first child started {b['first_child_started_at']}"
        )
    return lines


def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    raw = results["raw"]
    fan = results["fanout"]
    chain = results["chain"]
    lat = results["latency"]
    sub = results.get("submit")
    raw_chain = results["raw_chain"]
    rows: list[tuple[str, str, str, str]] = [
        (f"raw Celery no-op x{raw['tasks']} (send_task)", f"{raw['tasks_per_s']:.1f} tasks/s", "baseline", ""),
        (f"raw Celery chain of {raw_chain['tasks']}", f"{raw_chain['tasks_per_s']:.1f} tasks/s", "reference", ""),
        (f"orchestrated fan-out 1->{fan['middle_tasks']}->1", f"{fan['tasks_per_s']:.1f} tasks/s", "", ""),
        (
            "  fan-out / raw Celery",
            f"{fan['ratio_to_raw']:.2f}x",
            f">= {TARGET_FANOUT_RATIO:.2f}x",
            verdict(fan["ratio_to_raw"] >= TARGET_FANOUT_RATIO),
        ),
        (
            "  database transactions per task (server statistics)",
            f"{fan['transactions_per_task']:.2f}",
            f"<= {TARGET_TRANSACTIONS:.1f}",
            verdict(fan["transactions_per_task"] <= TARGET_TRANSACTIONS),
        ),
    ]
    if "postgres_cpu_ms_per_task" in fan:
        rows.append(
            (
                "  Postgres CPU per task (the bench database's backends)",
                f"{fan['postgres_cpu_ms_per_task']:.3f} ms",
                f"<= {TARGET_PG_CPU_MS:.1f} ms",
                verdict(fan["postgres_cpu_ms_per_task"] <= TARGET_PG_CPU_MS),
            )
        )
    chord_ = results.get("chord")
    if chord_ is not None:
        ratio = fan["tasks_per_s"] / chord_["tasks_per_s"]
        rows += [
            (f"Celery chord 1->{chord_['middle_tasks']}->1 (result backend)", f"{chord_['tasks_per_s']:.1f} tasks/s",
             "reference", ""),
            ("  fan-out / Celery chord", f"{ratio:.2f}x", f">= {TARGET_CHORD_RATIO:.2f}x",
             verdict(ratio >= TARGET_CHORD_RATIO)),
        ]  # fmt: skip
    rows += [
        (f"orchestrated chain of {chain['tasks']}", f"{chain['tasks_per_s']:.1f} tasks/s", "", ""),
        ("  chain, per link", f"{chain['step_ms']:.2f} ms", f"<= {TARGET_CHAIN_STEP_MS:.1f} ms",
         verdict(chain["step_ms"] <= TARGET_CHAIN_STEP_MS)),
        ("  chain / raw Celery", f"{chain['ratio_to_raw']:.2f}x", "(none)", ""),
        ("  chain / raw Celery chain", f"{chain['ratio_to_raw_chain']:.2f}x", "(none)", ""),
    ]  # fmt: skip
    canvas = results.get("canvas_chain")
    if canvas is not None:
        rows.append((f"  Celery canvas chain of {canvas['tasks']}, per link", f"{canvas['step_ms']:.2f} ms",
                     "reference", ""))  # fmt: skip
        rows.append(("  chain link / canvas chain link", f"{chain['step_ms'] / canvas['step_ms']:.2f}x", "< 1.00x",
                     verdict(chain["step_ms"] < canvas["step_ms"])))  # fmt: skip
    if sub is not None:
        rows.append(
            (
                f"submit {sub['nodes']:,}-node DAG (median of {len(sub['runs_s'])})",
                f"{sub['median_s'] * 1000:.0f} ms",
                f"<= {TARGET_SUBMIT_S * 1000:.0f} ms",
                verdict(sub["median_s"] <= TARGET_SUBMIT_S),
            )
        )
    rows += [
        ("parent finished -> child started, p50", f"{lat['p50_ms']:.2f} ms", "", ""),
        (
            "parent finished -> child started, p99",
            f"{lat['p99_ms']:.2f} ms",
            f"<= {TARGET_P99_MS:.0f} ms",
            verdict(lat["p99_ms"] <= TARGET_P99_MS),
        ),
    ]
    if raw_chain["hop"]:
        hop = raw_chain["hop"]
        rows.append(
            (
                "  raw Celery parent end -> child start, p50/p99",
                f"{hop['p50_ms']:.2f} / {hop['p99_ms']:.2f} ms",
                "reference",
                "",
            )
        )
    lim = results.get("limits")
    if lim:
        rows.append(
            (
                f"pool of {lim['pool_slots']} under {lim['pool_tasks']} tasks: most running at once",
                f"{lim['pool_most_running']} (in flight {lim['pool_most_in_flight']})",
                f"{lim['pool_slots']}",
                verdict(lim["pool_most_running"] == lim["pool_slots"] >= lim["pool_most_in_flight"]),
            )
        )
        if "kill_slots_back_s" in lim:
            target = lim["lease_s"] + lim["tick_s"]
            rows.append(
                (
                    "pool slots after kill -9 of their worker: back in",
                    f"{lim['kill_slots_back_s']:.2f} s",
                    f"<= lease + tick = {target:g} s",
                    verdict(lim["kill_slots_back_s"] <= target),
                )
            )
            rows.append(
                (
                    "pool slot of a cancelled run: admitted / claimed after",
                    f"{lim['cancel_admitted_ms']:.0f} / {lim['cancel_claimed_ms']:.0f} ms",
                    "at once",
                    "",
                )
            )
    fair = results.get("fairness")
    if fair:
        for label, target in (("equal", 1.0), ("3:1", 3.0)):
            f = fair[label]
            rows.append(
                (
                    f"fairness, weights {label}: A:B admissions while both READY",
                    f"{f['a_to_b']:.2f}",
                    f"{target:.0f} +-10%",
                    verdict(abs(f["a_to_b"] - target) <= 0.1 * target),
                )
            )
            # the completion target is for equal weights; at 3:1 B has a quarter of the slots
            rows.append(
                (
                    f"  B's 20 tasks behind A's {fair['backlog']} / B alone",
                    f"{f['b_vs_alone']:.2f}x",
                    "<= 3x" if label == "equal" else "(info)",
                    verdict(f["b_vs_alone"] <= 3.0) if label == "equal" else "",
                )
            )
        rows.append(
            (
                f"high task behind {fair['backlog']} low: submit -> start",
                f"{fair['high_start_s'] * 1000:.0f} ms",
                "",
                "",
            )
        )
    probe = results.get("planner_probe")
    if probe and "stale_ms" in probe:
        rows.append(
            (
                f"settle 1 task of a new {probe['tasks']}-task run, stale stats",
                f"{probe['stale_ms']:.1f} ms",
                "(probe)",
                "",
            )
        )
        rows.append(("  same after ANALYZE", f"{probe['analyzed_ms']:.2f} ms", "(probe)", ""))
    rows += map_rows(results)
    head = ("figure", "measured", "target", "met")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [
        "",
        "Orchestrator benchmark  "
        + "  ".join(f"{k}={v}" for k, v in meta.items() if k in ("concurrency", "cpus", "celery", "python")),
        f"  database {meta['database']}   broker {meta['broker']}",
        f"  server autovacuum={meta['autovacuum']}; --planner-stats {meta['planner_stats']}"
        f" ({PLANNER_STATS[meta['planner_stats']]})",
        f"  load average (1/5/15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"
        " - other processes on this machine skew every figure",
        "",
        "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [
        "",
        "details",
        f"  raw: {raw['tasks']} tasks, publish {raw['publish_s']:.3f}s, first publish -> last executed"
        f" {raw['elapsed_s']:.3f}s (each task INCRs a Redis counter)",
        f"  fan-out: submit -> run final {fan['elapsed_s']:.3f}s wall, {fan['db_span_s']:.3f}s DB clock;"
        f" {fan['all_tasks_per_s']:.1f} tasks/s counting all {fan['total_tasks']};"
        f" per task claim -> succeed p50 {fan['claim_to_commit']['p50_ms']:.2f} ms"
        f" p99 {fan['claim_to_commit']['p99_ms']:.2f} ms; dispatched -> claimed p50"
        f" {fan['dispatch_to_claim']['p50_ms']:.2f} ms p99 {fan['dispatch_to_claim']['p99_ms']:.2f} ms;"
        f" rejected events {fan['rejected_events']}",
        f"  raw chain: {raw_chain['elapsed_s']:.3f}s, {raw_chain['step_ms']:.2f} ms per step (each link sends the"
        " next at the end of its body; hop = child body start - parent body end, worker clock)",
        f"  chain: submit -> run final {chain['elapsed_s']:.3f}s wall, {chain['db_span_s']:.3f}s DB clock;"
        f" {chain['step_ms']:.2f} ms per step; per task claim -> succeed p50"
        f" {chain['claim_to_commit']['p50_ms']:.2f} ms; rejected events {chain['rejected_events']}",
        f"  parent -> child over {lat['n']} chain edges: min {lat['min_ms']:.2f}  p50 {lat['p50_ms']:.2f}"
        f"  p90 {lat['p90_ms']:.2f}  p99 {lat['p99_ms']:.2f}  max {lat['max_ms']:.2f} ms"
        " (parent finished_at = now() of its succeed transaction, i.e. its start, not its commit)",
    ]
    lines += map_details(results)
    if sub is not None:
        runs = ", ".join(f"{t * 1000:.0f}" for t in sub["runs_s"])
        lines.append(
            f"  submit: {sub['shape']} on an unconsumed queue, separate database; runs {runs} ms;"
            f" building the DAG object (not timed in submit) {sub['dag_build_s'] * 1000:.0f} ms"
        )
        b = sub["breakdown"]
        lines.append(f"  submit breakdown (one instrumented submit, {b['total_s'] * 1000:.0f} ms total):")
        for name, v in b["steps"].items():
            lines.append(f"    {name:<46} {v['s'] * 1000:8.1f} ms  ({v['calls']} calls)")
        lines.append(f"    {'SQL round trips (cursor execute), total':<46} {b['sql_total_s'] * 1000:8.1f} ms")
        for name, v in b["sql"].items():
            lines.append(f"      {name:<44} {v['s'] * 1000:8.1f} ms  ({v['calls']} executes)")
        if "profile" in sub:
            lines += ["", "cProfile of one submit (top 30 by cumulative time):", sub["profile"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork), default 2")
    p.add_argument("--raw-tasks", type=int, default=2000, help="plain Celery no-op tasks, default 2000")
    p.add_argument("--fanout", type=int, default=2000, help="middle tasks of the fan-out DAG, default 2000")
    p.add_argument("--chain", type=int, default=500, help="tasks of the chain DAG, default 500")
    p.add_argument(
        "--fairness-tasks",
        type=int,
        default=3000,
        help="tenant A's low backlog in the fairness scenario, default 3000 (0 skips it)",
    )
    p.add_argument("--submit-nodes", type=int, default=10_000, help="nodes of the submit DAG, default 10000")
    p.add_argument("--submit-repeat", type=int, default=3, help="timed submits (median reported), default 3")
    p.add_argument("--profile-submit", action="store_true", help="also print a cProfile of one submit")
    p.add_argument("--no-canvas", action="store_true", help="skip the Celery chord / canvas chain reference")
    p.add_argument("--database-url", default=DEFAULT_DB, help=f"bench database (re-created!), default {DEFAULT_DB}")
    p.add_argument(
        "--redis-url", default=DEFAULT_REDIS, help=f"bench Redis database (flushed!), default {DEFAULT_REDIS}"
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds each phase may take, default 180")
    p.add_argument(
        "--planner-stats",
        choices=("run", "warmup", "none"),
        default="none",
        help="when to ANALYZE the orc_* tables (the bench server runs with autovacuum off):\n"
        "run: after the warm-up and right after each measured submit;\n"
        "warmup: after the warm-up only, so every measured run is unknown to the planner;\n"
        "none: never (default; the store's queries no longer depend on fresh statistics)",
    )
    p.add_argument(
        "--planner-probe",
        type=int,
        default=2000,
        help="time the child-counter update of one task of a new 1->N->1 run, before and\n"
        "after ANALYZE (in the submit database, rolled back; 0 skips it), default 2000",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=5.0,
        help="lease seconds of the two workers of the slot-recovery scenario, default 5 (0 skips it)",
    )
    p.add_argument(
        "--maps",
        action="store_true",
        help="run the map scenarios on the worker (issue 19): map --map-n vs the static fan-out,\n"
        "the chained map, the big map (minutes at the defaults; see --no-map-big)",
    )
    p.add_argument(
        "--map-n",
        type=int,
        default=10_000,
        help="items of the map and its static reference (with --maps), and of the expansion probe,\n"
        "which runs in every run (no worker, a few seconds); default 10000, 0 skips both",
    )
    p.add_argument("--map-big-n", type=int, default=100_000, help="items of the big map (with --maps), default 100000")
    p.add_argument("--no-map-big", action="store_true", help="with --maps, skip the big map")
    p.add_argument(
        "--chained-n",
        type=int,
        default=1000,
        help=f"items of the {CHAINED_DEPTH}-stage chained map (with --maps), default 1000, 0 skips it",
    )
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object (last line)")
    args = p.parse_args(argv)
    for name in ("concurrency", "raw_tasks", "fanout", "chain", "submit_repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.planner_probe < 0:
        p.error("--planner-probe must be 0 or more")
    if args.submit_nodes < 2:
        p.error("--submit-nodes must be at least 2")
    for name in ("map_n", "map_big_n", "chained_n"):
        if not 0 <= getattr(args, name) <= 100_000:
            p.error(f"--{name.replace('_', '-')} must be 0 to 100000 (a map's most items)")
    if args.map_big_n < 1 and args.maps and not args.no_map_big:
        p.error("--map-big-n must be at least 1 (or pass --no-map-big)")
    args.no_map_big = args.no_map_big or not args.maps
    return args


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit so the worker is still stopped by the ``finally`` blocks."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.redis_url.startswith("redis://"):
        raise SystemExit("--redis-url must be redis://host:port/db")
    data_dir = Path(tempfile.mkdtemp(prefix="orc-bench-"))
    env_settings = {
        "ORCHESTRATOR_DATABASE_URL": args.database_url,
        "ORCHESTRATOR_BROKER_URL": args.redis_url,
        "ORCHESTRATOR_DATA_DIR": str(data_dir),
        "ORCHESTRATOR_TASK_MODULES": TASK_MODULES,
    }
    # this process uses the very same settings as the worker: set them before importing the app
    os.environ.update(env_settings)
    worker_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    import celery
    import redis

    from bench.canvas_app import backend_url as canvas_backend_url

    submit_url = derived_url(args.database_url, "_submit")
    probe_url = derived_url(args.database_url, "_probe")
    map_url = derived_url(args.database_url, "_map")
    map_probe_sizes = [n for n in (args.map_n, 0 if args.no_map_big else args.map_big_n) if n > 0]
    log(f"resetting {args.database_url}, {submit_url}, {probe_url} and {map_url}; flushing {args.redis_url}")
    reset_database(args.database_url)
    reset_database(submit_url)
    if args.planner_probe > 0:
        reset_database(probe_url)
    if map_probe_sizes:
        reset_database(map_url)
    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    redis.Redis.from_url(canvas_backend_url(args.redis_url)).flushdb()

    from orchestrator.core.errors import OrchestratorError
    from orchestrator.core.routing import default_queues
    from orchestrator.runtime.celery_app import get_app

    app = get_app()
    app.loader.import_default_modules()
    raw_task = app.tasks["bench.raw_noop"]
    conf = app.conf
    if not (conf.task_acks_late and conf.worker_prefetch_multiplier == 1 and raw_task.acks_late):
        raise BenchError("expected task_acks_late and worker_prefetch_multiplier=1 for both task kinds")

    worker = Worker(
        env=worker_env,
        concurrency=args.concurrency,
        queues=",".join(default_queues()),
        logfile=data_dir / "worker.log",
    )
    canvas_worker = Worker(
        env=worker_env,
        concurrency=args.concurrency,
        queues="bench.canvas",
        logfile=data_dir / "canvas-worker.log",
        app_module="bench.canvas_app",
    )
    bench = Bench(args, worker, r)
    meta = {
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "celery": celery.__version__,
        "python": platform.python_version(),
        "database": args.database_url,
        "submit_database": submit_url,
        "probe_database": probe_url,
        "map_database": map_url,
        "maps": args.maps,
        "broker": args.redis_url,
        "worker": "prefork, acks_late, prefetch multiplier 1, queues " + worker.queues,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "autovacuum": server_setting(args.database_url, "autovacuum"),
        "planner_stats": args.planner_stats,
    }
    ok = False
    started = time.perf_counter()
    with sigterm_as_exit():
        try:
            worker.start()
            bench.warm_up()
            bench.bench_raw()
            bench.bench_raw_chain()
            bench.bench_fanout()
            bench.bench_chain()
            bench.bench_latency()
            bench.bench_fairness()
            bench.bench_pool()
            if args.maps:
                bench.bench_maps()
            worker.stop()  # not needed for the canvas and submit phases
            if args.lease > 0:
                bench.bench_slot_recovery(
                    lambda name: Worker(
                        env={**worker_env, "ORCHESTRATOR_LEASE_SECONDS": str(args.lease)},
                        concurrency=2,
                        queues=",".join(default_queues()),
                        logfile=data_dir / f"worker{name}.log",
                        name=name,
                    )
                )
            if not args.no_canvas:
                bench.bench_canvas(canvas_worker)
            bench.bench_submit(submit_url)
            if args.planner_probe > 0:
                bench.planner_probe(probe_url)
            if map_probe_sizes:
                bench.map_expand_probe(map_url, map_probe_sizes)
            ok = True
        except (BenchError, OrchestratorError) as exc:
            log(f"FAILED: {type(exc).__name__}: {exc}")
        except KeyboardInterrupt:
            log("interrupted")
        finally:
            if worker.proc is not None and not ok:
                log(f"worker log tail:\n{worker.log_tail()}")
            worker.stop()
            canvas_worker.stop()
            with contextlib.suppress(Exception):
                r.flushdb()
            with contextlib.suppress(Exception):
                redis.Redis.from_url(canvas_backend_url(args.redis_url)).flushdb()
            with contextlib.suppress(Exception):
                bench.orchestrator().store.dispose()
    meta["total_s"] = round(time.perf_counter() - started, 1)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if not ok:
        log(f"kept the data dir {data_dir} for inspection")
        if bench.results:
            print(json.dumps({"meta": meta, "results": bench.results, "complete": False}, default=str))
        return 1
    shutil.rmtree(data_dir, ignore_errors=True)
    print(report(bench.results, meta))
    print(f"\n(total bench time {meta['total_s']}s)")
    if args.json:
        print(json.dumps({"meta": meta, "results": bench.results, "complete": True}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
