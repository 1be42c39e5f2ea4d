"""Where an orchestrated fan-out task's CPU goes: ``/proc`` CPU time of the worker's main process,
its pool processes, Postgres, Redis and this process over a 1 -> N -> 1 fan-out on one real
worker (``-c 2``), and the server functions' time (``track_functions = all``). With ``--raw``
the same for N raw Celery no-ops. Run from the repository root (it re-creates the bench
database and flushes the bench Redis database, like ``bench.py``)::

    python bench/cpu_profile.py [N] [--raw | --shape fanout|map|static-map]

``--shape map`` profiles ``dag.map`` over a source's N items and ``--shape static-map`` the same
shape written out statically (``bench.bench``'s big-map comparison, per task).

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
        "--shape", choices=("fanout", "map", "static-map"), default="fanout", help="the orchestrated DAG's shape"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="bench Redis database (flushed!)")
    args = parser.parse_args()
    os.environ.update(
        ORCHESTRATOR_DATABASE_URL=DB,
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

    b.reset_database(DB)
    admin = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text("ALTER DATABASE orchestrator_bench SET track_functions = 'all'"))
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

        def snap() -> dict[str, float]:
            return {
                "worker main": cpu(main_pid),
                "pool processes": sum(cpu(p) for p in pids("-P", str(main_pid))),
                "postgres": sum(cpu(p) for p in pids("-x", "postgres")),
                "redis": sum(cpu(p) for p in pids("-x", "redis-server")),
                "this process": cpu(os.getpid()),
            }

        before, t0 = snap(), time.perf_counter()
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
            orc.submit(shapes[args.shape](n, "fan")).wait(900, poll=0.05)
        elapsed = time.perf_counter() - t0
        after = snap()
        print(f"{n} tasks in {elapsed:.2f}s = {n / elapsed:.0f}/s")
        total = 0.0
        for k in before:
            per = (after[k] - before[k]) / n * 1000
            total += per
            print(f"  {k:15s} {per:.2f} ms CPU per task")
        print(f"  {'total':15s} {total:.2f} ms CPU per task; the two cores give {elapsed * 2 / n * 1000:.2f}")
        if not args.raw:
            time.sleep(0.7)  # the statistics collector flushes every 500 ms
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
