"""What admission costs per task, counted by the database (not timed): transactions, server
function calls and index scans, for tasks claimed and succeeded one at a time through the hot path
(as a worker does, without Celery) on a database of its own.

    python bench/admission_counts.py [--tasks 400] [--advertise] [--db orchestrator_counts]

``--advertise``: the worker registers the task names it has (``orc_worker_tasks``), as workers do
since the watchdog; without it, a worker that says nothing (an earlier release; ``*``). ``--held N``
adds N tasks of a name the worker did not register (held READY, looked past by every admission). Run it on
an earlier release's checkout to compare (the flag is then ignored). Counters are Postgres's own:
``pg_stat_database.xact_commit``, ``pg_stat_user_functions`` (``track_functions = 'all'`` is set
on the database it creates) and ``pg_stat_user_tables``."""

from __future__ import annotations

import argparse
import inspect
import json
import time
from typing import Any

import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.store import Store, make_engine
from orchestrator.store.migrate import upgrade
from orchestrator.store.schema import tasks as t

COUNTERS = """
SELECT (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()) AS xacts,
       (SELECT coalesce(json_object_agg(funcname, calls), '{}') FROM pg_stat_user_functions) AS functions,
       (SELECT coalesce(json_object_agg(relname, json_build_array(coalesce(idx_scan, 0), coalesce(seq_scan, 0))), '{}')
        FROM pg_stat_user_tables WHERE relname IN ('orc_tasks', 'orc_worker_tasks', 'orc_workers')) AS tables
"""


def counters(url: str) -> dict[str, Any]:
    """The database's counters, read once every other session of this process is closed (a
    session's statistics are flushed when it ends)."""
    time.sleep(0.5)
    engine = make_engine(url)
    with engine.connect() as conn:
        row = conn.execute(sa.text(COUNTERS)).one()
    engine.dispose()
    return {"xacts": int(row.xacts), "functions": dict(row.functions), "tables": dict(row.tables)}


def close(store: Store) -> None:
    store.attempts.hot.close()
    store.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--advertise", action="store_true")
    p.add_argument("--held", type=int, default=0, help="READY tasks of a name no worker registered (with --advertise)")
    p.add_argument("--passes", type=int, default=50, help="reconciler passes counted after the tasks (0: none)")
    p.add_argument("--db", default="orchestrator_counts")
    p.add_argument("--server", default="postgresql+psycopg://postgres@127.0.0.1:5432")
    a = p.parse_args()
    admin = sa.create_engine(f"{a.server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{a.db}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{a.db}"'))
        conn.execute(sa.text(f"ALTER DATABASE \"{a.db}\" SET track_functions = 'all'"))
    admin.dispose()
    url = f"{a.server}/{a.db}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store(url)
    register = store.workers.register
    if "tasks" in inspect.signature(register).parameters:
        register("w", default_queues(), 4, tasks=["t"] if a.advertise else None)
    else:
        register("w", default_queues(), 4)
    orc = Orchestrator(
        Settings(database_url=url, dispatch_depth=2),
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t", "u"]),
    )
    dag = DAG("counts")
    for i in range(a.held):
        dag.task(f"h{i:05d}", "u")  # held READY: the worker did not register "u"
    for i in range(a.tasks):
        dag.task(f"n{i:05d}", "t")
    run_id = orc.submit(dag).id
    close(store)
    before = counters(url)
    store = Store(url)
    done = 0
    while True:
        with store.engine.connect() as conn:
            task = conn.execute(
                sa.select(t.c.key, t.c.attempt).where(t.c.run_id == run_id, t.c.state == "QUEUED").limit(1)
            ).first()
        if task is None:
            break
        assert store.attempts.claim(run_id, task.key, task.attempt, "w:1", 60.0, "t") is not None
        store.attempts.succeed(run_id, task.key, task.attempt, None, 10_000)
        done += 1
    close(store)
    after = counters(url)
    fns = {k: after["functions"].get(k, 0) - before["functions"].get(k, 0) for k in after["functions"]}
    tables = {k: [after["tables"][k][i] - before["tables"].get(k, [0, 0])[i] for i in (0, 1)] for k in after["tables"]}
    out = {
        "tasks": done,
        "transactions_per_task": round((after["xacts"] - before["xacts"]) / max(done, 1), 3),
        "function_calls_per_task": {k: round(v / max(done, 1), 3) for k, v in sorted(fns.items()) if v},
        "index_scans_per_task": {k: round(v[0] / max(done, 1), 3) for k, v in sorted(tables.items())},
        "seq_scans_per_task": {k: round(v[1] / max(done, 1), 3) for k, v in sorted(tables.items())},
    }
    if a.passes:
        # the reconciler's passes over the finished work, back to back: the first reads the READY
        # backlog and the idle runs, the others only what every pass reads
        from orchestrator.services.reconciler import Reconciler

        store = Store(url)
        registry = StaticRegistry(["t", "u"])
        orc = Orchestrator(orc.settings, store=store, publisher=RecordingPublisher(), registry=registry)
        close(store)
        start = counters(url)
        store = Store(url)
        reconciler = Reconciler(store, RecordingPublisher(), orc.settings)
        for _ in range(a.passes):
            reconciler.run_pass()
        close(store)
        end = counters(url)
        out["transactions_per_reconciler_pass"] = round((end["xacts"] - start["xacts"]) / a.passes, 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
