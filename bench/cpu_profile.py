"""Where an orchestrated fan-out task's CPU goes: ``/proc`` CPU time of the worker's main process,
its pool processes, Postgres, Redis and this process over a 1 -> N -> 1 fan-out on one real
worker (``-c 2``), and the server functions' time (``track_functions = all``). With ``--raw``
the same for N raw Celery no-ops. Run from the repository root (it re-creates the bench
database and flushes the bench Redis database, like ``bench.py``)::

    python bench/cpu_profile.py [N] [--raw | --shape fanout|fanins|map|static-map] [--width W]
                                [--database-url URL] [--redis-url URL]

``--shape map`` profiles ``dag.map`` over a source's N items and ``--shape static-map`` the same
shape written out statically (``bench.bench``'s big-map comparison, per task). ``--shape fanins
--width W`` splits the N middle tasks into fan-ins of W, each with its own join, all joins into
one sink (one run): the settlement's cost per task against the fan-in's width.

"postgres" is the CPU of every Postgres process on the machine (the postmaster's reaped
children included); "bench db backends" only the backends connected to the bench database
during the run (alive at its start and end: the worker's pooled sessions), which other
databases' load on a shared machine does not touch. "per task" gives the work the bench
database did (``pg_stat_database``: transactions, buffers hit or read, rows read and written),
which the machine's load does not change either.

The figures in bench/README.md ("where a fan-out task's time goes") come from this script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench"


def fanins_dag(n: int, name: str, width: int) -> object:
    """1 root -> ``n`` middle no-ops in fan-ins of ``width``, each into its own join -> 1 sink."""
    from bench.bench import NOOP
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    root = dag.task("root", NOOP)
    joins = []
    for g in range(0, n, width):
        mids = [dag.task(f"m{i:06d}", NOOP, upstream=[root]) for i in range(g, min(g + width, n))]
        joins.append(dag.task(f"j{g // width:05d}", NOOP, upstream=mids))
    dag.task("sink", NOOP, upstream=joins)
    return dag


HZ = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ
    except OSError:
        return 0.0


def pids(*args: str) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", *args], capture_output=True, text=True).stdout.split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=3000)
    parser.add_argument("--raw", action="store_true", help="raw Celery no-ops instead of an orchestrated fan-out")
    parser.add_argument(
        "--shape",
        choices=("fanout", "fanins", "map", "static-map"),
        default="fanout",
        help="the orchestrated DAG's shape",
    )
    parser.add_argument("--width", type=int, default=100, help="--shape fanins: tasks per fan-in (default 100)")
    parser.add_argument("--database-url", default=DB, help="bench database (dropped and re-created!)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="bench Redis database (flushed!)")
    args = parser.parse_args()
    db = args.database_url
    os.environ.update(
        ORCHESTRATOR_DATABASE_URL=db,
        ORCHESTRATOR_BROKER_URL=args.redis_url,
        ORCHESTRATOR_DATA_DIR=tempfile.mkdtemp(),
        ORCHESTRATOR_TASK_MODULES="tasks.probes,tasks.etl,bench.raw_tasks",
    )
    import redis
    import sqlalchemy as sa

    import bench.bench as b
    from orchestrator.core.routing import default_queues
    from orchestrator.engine.facade import Orchestrator
    from orchestrator.runtime.celery_app import get_app

    b.reset_database(db)
    db_name = sa.engine.make_url(db).database
    admin = sa.create_engine(sa.engine.make_url(db).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"ALTER DATABASE \"{db_name}\" SET track_functions = 'all'")
    admin.dispose()
    broker = redis.Redis.from_url(os.environ["ORCHESTRATOR_BROKER_URL"])
    broker.flushdb()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = b.Worker(
        env=env, concurrency=2, queues=",".join(default_queues()), logfile=Path(tempfile.mkdtemp()) / "w.log"
    )
    n = args.n
    try:
        worker.start()
        app = get_app()
        orc = Orchestrator(app=app)
        orc.submit(b.fanout_dag(50, "warm")).wait(60, poll=0.01)
        assert worker.proc is not None
        main_pid = worker.proc.pid

        def backends() -> set[int]:
            with orc.store.engine.connect() as conn:
                rows = conn.execute(
                    sa.text(
                        "select pid from pg_stat_activity where datname = current_database()"
                        " and pid <> pg_backend_pid()"
                    )
                ).scalars()
                return set(rows)

        def snap(mine: dict[int, float]) -> dict[str, float]:
            return {
                "worker main": cpu(main_pid),
                "pool processes": sum(cpu(p) for p in pids("-P", str(main_pid))),
                "postgres": sum(cpu(p) for p in pids("-x", "postgres")),
                "bench db backends": sum(mine.values()),
                "redis": sum(cpu(p) for p in pids("-x", "redis-server")),
                "this process": cpu(os.getpid()),
            }

        def db_stats() -> dict[str, float]:
            with orc.store.engine.connect() as conn:
                row = conn.execute(
                    sa.text(
                        "select xact_commit + xact_rollback as transactions, blks_hit + blks_read as buffers,"
                        " tup_fetched + tup_returned as rows_read, tup_inserted + tup_updated + tup_deleted"
                        " as rows_written from pg_stat_database where datname = current_database()"
                    )
                ).one()
            return dict(row._mapping)

        stats0 = db_stats()
        start = {p: cpu(p) for p in backends()}
        before, t0 = snap({}), time.perf_counter()
        if args.raw:
            from bench.raw_tasks import RAW_COUNTER, RAW_TASK

            broker.delete(RAW_COUNTER)
            with app.producer_or_acquire() as producer:
                for _ in range(n):
                    app.send_task(RAW_TASK, queue="orchestrator.default", producer=producer)
            while int(broker.get(RAW_COUNTER) or 0) < n:
                time.sleep(0.002)
        else:
            shapes = {"fanout": b.fanout_dag, "map": b.map_dag, "static-map": b.static_map_dag}
            dag = fanins_dag(n, "fan", args.width) if args.shape == "fanins" else shapes[args.shape](n, "fan")
            orc.submit(dag).wait(900, poll=0.05)
        elapsed = time.perf_counter() - t0
        alive = backends() & set(start)  # those alive at both ends
        after = snap({p: cpu(p) - start[p] for p in alive})
        print(f"{n} tasks in {elapsed:.2f}s = {n / elapsed:.0f}/s")
        total = 0.0
        for k in before:
            per = (after[k] - before[k]) / n * 1000
            total += per if k != "bench db backends" else 0.0
            print(f"  {k:15s} {per:.2f} ms CPU per task")
        print(f"  {'total':15s} {total:.2f} ms CPU per task; the two cores give {elapsed * 2 / n * 1000:.2f}")
        if not args.raw:
            worker.stop()  # its sessions end, and their statistics are flushed
            time.sleep(0.7)
            # work done in the bench database, whatever the machine's load (this process's polls
            # included): per task
            stats1 = db_stats()
            print("  per task: " + ", ".join(f"{k} {(stats1[k] - stats0[k]) / n:.1f}" for k in stats0))
            with orc.store.engine.connect() as conn:
                rows = conn.execute(
                    sa.text("select funcname, calls, total_time, self_time from pg_stat_user_functions order by 3 desc")
                ).all()
            for name, calls, total_ms, self_ms in rows:
                each, own = total_ms / max(calls, 1), self_ms / max(calls, 1)
                print(f"  {name:15s} {calls:6d} calls  {each:.3f} ms each (self {own:.3f})")
        return 0
    finally:
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
