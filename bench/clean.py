"""``orchestrator db clean`` beside a running fan-out: does pruning a big ledger fight the hot path?

    python bench/clean.py [--ledger-rows 10000000] [--fanout 2000] [--batch 500] [--pause 0]

On its own database (``orchestrator_bench_clean``, re-created) and Redis db 10, with one real
worker (``-c 2``):

1. runs a small DAG to completion and copies its rows (the run, its tasks, edges and ledger) into
   old finished runs, 40 days back, until the ledger holds ``--ledger-rows`` rows (server-side
   ``INSERT ... SELECT``, in chunks);
2. times a 1 -> N -> 1 fan-out three times with nothing else running;
3. starts ``orchestrator db clean --before <30 days ago> --batch B --json`` in a subprocess and
   times fan-outs back to back until it ends;
4. prints the clean's wall time and rows per second, each fan-out's tasks/s, and the ratio of the
   fan-outs during the clean to those without it (the issue's target: >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_clean"
REDIS = "redis://127.0.0.1:6379/10"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledger-rows", type=int, default=10_000_000)
    parser.add_argument("--fanout", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=500, help="runs per clean transaction (db clean --batch)")
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between the clean's batches (db clean --pause)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="the most seconds the clean may take")
    parser.add_argument(
        "--functions", action="store_true", help="print the server functions' time of the fan-outs alone"
    )
    parser.add_argument(
        "--no-analyze",
        action="store_true",
        help="leave the tables un-ANALYZEd after seeding (planner statistics stale)",
    )
    parser.add_argument("--seed-only", action="store_true", help="stop after seeding (the database is left as it is)")
    a = parser.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="orc-bench-clean-"))
    settings = {
        "ORCHESTRATOR_DATABASE_URL": DB,
        "ORCHESTRATOR_BROKER_URL": REDIS,
        "ORCHESTRATOR_DATA_DIR": str(data_dir),
        "ORCHESTRATOR_TASK_MODULES": "tasks.probes,tasks.etl,bench.raw_tasks",
    }
    os.environ.update(settings)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    import redis
    import sqlalchemy as sa

    from bench.bench import Worker, fanout_dag, log, reset_database
    from orchestrator.core.routing import default_queues
    from orchestrator.engine.facade import Orchestrator

    log(f"resetting {DB}; flushing {REDIS}")
    reset_database(DB)
    admin = sa.create_engine(DB, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # the server functions' time, for --functions
        conn.execute(sa.text("ALTER DATABASE orchestrator_bench_clean SET track_functions = 'all'"))
    admin.dispose()
    redis.Redis.from_url(REDIS).flushdb()
    worker = Worker(env=env, concurrency=2, queues=",".join(default_queues()), logfile=data_dir / "worker.log")
    worker.start()
    clean: subprocess.Popen[str] | None = None
    try:
        from orchestrator.runtime.celery_app import get_app

        orc = Orchestrator(app=get_app())
        engine = orc.store.engine

        def fan_out(tag: str) -> float:
            t0 = time.perf_counter()
            view = orc.submit(fanout_dag(a.fanout, f"clean-bench-{tag}")).wait(600, poll=0.01)
            if view.state.value != "SUCCEEDED":
                raise SystemExit(f"fan-out {tag} ended {view.state.value}")
            return (a.fanout + 2) / (time.perf_counter() - t0)

        fan_out("warm-up")  # also the worker's first tasks
        # the template: a finished run of 10 tasks, copied into old runs
        template = orc.submit(fanout_dag(8, "clean-bench-template")).wait(120, poll=0.05)
        assert template.state.value == "SUCCEEDED"
        tid = template.id
        with engine.begin() as conn:
            per_run = conn.execute(
                sa.text("SELECT count(*) FROM orc_task_events WHERE run_id = :r"), {"r": tid}
            ).scalar_one()
        runs_needed = max(a.ledger_rows // per_run, 1)
        log(f"seeding {runs_needed} old runs of {per_run} ledger rows each ({runs_needed * per_run} rows)")

        def columns(conn: sa.Connection, table: str) -> list[str]:
            q = "SELECT column_name FROM information_schema.columns WHERE table_name = :t ORDER BY ordinal_position"
            return list(conn.execute(sa.text(q), {"t": table}).scalars())

        t_seed = time.perf_counter()
        chunk = 20_000
        with engine.connect() as conn:
            cols = {t: columns(conn, t) for t in ("orc_runs", "orc_tasks", "orc_edges", "orc_task_events")}
            conn.commit()
        shifted = {"created_at", "finished_at", "at", "ready_at", "dispatched_at", "started_at", "heartbeat_at"}

        def copy_sql(table: str, id_col: str) -> str:
            exprs = []
            names = []
            for c in cols[table]:
                if table == "orc_task_events" and c == "id":
                    continue
                names.append(f'"{c}"')
                if c == id_col:
                    exprs.append(f"md5(src.{c} || '-' || g)")
                elif c == "idempotency_key":
                    exprs.append("NULL")
                elif c in shifted:
                    exprs.append(f"src.{c} - interval '40 days'")
                else:
                    exprs.append(f'src."{c}"')
            return (
                f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(exprs)} FROM {table} AS src,"
                f" generate_series(CAST(:lo AS integer), CAST(:hi AS integer)) AS g WHERE src.{id_col} = :tid"
            )

        statements = [
            copy_sql("orc_runs", "id"),
            copy_sql("orc_tasks", "run_id"),
            copy_sql("orc_edges", "run_id"),
            copy_sql("orc_task_events", "run_id"),
        ]
        for lo in range(1, runs_needed + 1, chunk):
            hi = min(lo + chunk - 1, runs_needed)
            with engine.begin() as conn:
                for sql in statements:
                    conn.execute(sa.text(sql), {"lo": lo, "hi": hi, "tid": tid})
        with engine.connect() as conn:
            if not a.no_analyze:
                conn.execute(sa.text("ANALYZE"))
            ledger = conn.execute(sa.text("SELECT count(*) FROM orc_task_events")).scalar_one()
            conn.commit()
        log(f"seeded in {time.perf_counter() - t_seed:.1f}s: ledger {ledger} rows")

        if a.seed_only:
            log(f"--seed-only: {DB} left seeded")
            return
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_stat_reset()"))
            conn.commit()
        alone = [fan_out(f"alone-{i}") for i in range(3)]
        log(f"fan-out alone: {', '.join(f'{x:.1f}' for x in alone)} tasks/s")
        if a.functions:
            time.sleep(0.6)  # the statistics collector's flush
            q = "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions ORDER BY 3 DESC LIMIT 12"
            with engine.connect() as conn:
                for name, calls, total, self_ in conn.execute(sa.text(q)):
                    each, own = total / max(calls, 1), self_ / max(calls, 1)
                    print(f"  {name:<22} {calls:>7} calls  {each:7.3f} ms each (self {own:.3f})")

        cmd = [sys.executable, "-m", "orchestrator.cli", "db", "clean", "--before", "30d"]
        cmd += ["--batch", str(a.batch), "--pause", str(a.pause), "--json"]
        t_clean = time.perf_counter()
        clean = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        during = []
        while clean.poll() is None:
            if time.perf_counter() - t_clean > a.timeout:
                raise SystemExit(f"the clean took more than {a.timeout}s")
            during.append(fan_out(f"during-{len(during)}"))
        clean_s = time.perf_counter() - t_clean
        out, err = clean.communicate()
        if clean.returncode != 0:
            raise SystemExit(f"db clean failed ({clean.returncode}): {err[-2000:]}")
        report = json.loads(out)
        with engine.connect() as conn:
            left = conn.execute(sa.text("SELECT count(*) FROM orc_task_events")).scalar_one()
        removed = int(report.get("events", 0))
        print()
        print(
            f"db clean beside a fan-out: ledger {ledger} rows, {runs_needed} old runs,"
            f" batch {a.batch} runs, pause {a.pause} s"
        )
        print(f"  clean: {clean_s:.1f}s wall, {removed} ledger rows removed ({removed / clean_s:,.0f} rows/s),")
        print(f"         {report.get('runs')} runs, {report.get('tasks')} tasks, {report.get('edges')} edges,")
        print(f"         {report.get('batches')} batches; ledger rows left {left}")
        print(f"  fan-out 1->{a.fanout}->1 alone:  {', '.join(f'{x:.1f}' for x in alone)} tasks/s")
        if during:
            print(f"  fan-out during the clean: {', '.join(f'{x:.1f}' for x in during)} tasks/s")
            ratio = statistics.median(during) / statistics.median(alone)
            print(f"  during / alone (medians) = {ratio:.2f}   (target >= 0.80)")
        else:
            print("  the clean ended before a fan-out could run beside it")
    finally:
        if clean is not None and clean.poll() is None:
            clean.kill()
            clean.wait(10)
        worker.stop()


if __name__ == "__main__":
    main()
