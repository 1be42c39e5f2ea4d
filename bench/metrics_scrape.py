"""What one ``/metrics`` scrape costs on a large database (Postgres).

    python bench/metrics_scrape.py [--tasks 200000] [--events 1000000] [--open 0.05] [--repeat 5]

Builds a fresh database (``<db>_metrics``, dropped and made again): ``--tasks`` tasks submitted
through ``Orchestrator.submit`` in DAGs of 10,000 nodes, all but ``--open`` of them then marked
SUCCEEDED, and ``--events`` ledger rows spread over the last two hours (so the 15-minute window
holds about an eighth of them, and the scrape reads at most its newest 10,000). Then it times
``orchestrator.web.metrics.render`` ``--repeat`` times and prints the median and the worst, with
``EXPLAIN ANALYZE`` timings of the snapshot's heaviest query. The rows are written with plain SQL
(a benchmark fixture, not a history the ledger would accept), so ``orchestrator verify`` is not
meant to pass on this database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench"
NODES = 10_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=DEFAULT_URL, help="the database's name gets a _metrics suffix")
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--open", type=float, default=0.05, help="share of tasks left open (PENDING/READY)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from orchestrator import DAG, Orchestrator, Settings
    from orchestrator.core.publisher import RecordingPublisher
    from orchestrator.core.registry import StaticRegistry
    from orchestrator.store import make_engine, migrate
    from orchestrator.web import metrics

    url = sa.engine.make_url(args.database_url)
    url = url.set(database=f"{url.database}_metrics")
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.database}"'))
        conn.execute(sa.text(f'CREATE DATABASE "{url.database}"'))
    admin.dispose()
    engine = make_engine(url.render_as_string(hide_password=False))
    migrate.reset(engine)
    engine.dispose()

    settings = Settings.from_env({}, database_url=url.render_as_string(hide_password=False))
    orc = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(["bench.noop"]))
    started = time.monotonic()
    made = 0
    while made < args.tasks:
        n = min(NODES, args.tasks - made)
        dag = DAG(f"metrics-bench-{made // NODES % 7}", tenant=f"tenant{made // NODES % 3}")
        root = dag.task("root", "bench.noop")
        for i in range(1, n):
            dag.task(f"t{i}", "bench.noop", upstream=[root], queue=f"orchestrator.q{i % 4}")
        orc.submit(dag)
        made += n
    with orc.store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE orc_tasks SET state = 'SUCCEEDED', started_at = now() - interval '1 hour',"
                " finished_at = now() - interval '59 minutes' WHERE random() >= :open"
            ),
            {"open": args.open},
        )
        conn.execute(
            sa.text("UPDATE orc_tasks SET state = 'READY', ready_at = now() WHERE state = 'PENDING' AND random() < 0.5")
        )
        per_task = max(1, args.events // max(made, 1))
        conn.execute(
            sa.text(
                "INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, accepted, at)"
                " SELECT t.run_id, t.key, 1, s.src, s.dst, 'worker', true,"
                "        now() - (random() * interval '2 hours')"
                " FROM orc_tasks t CROSS JOIN generate_series(1, :per) g"
                " JOIN (VALUES (0, 'READY', 'QUEUED'), (1, 'QUEUED', 'RUNNING'), (2, 'RUNNING', 'SUCCEEDED'))"
                "      AS s(n, src, dst) ON s.n = g % 3"
            ),
            {"per": per_task},
        )
        conn.execute(sa.text("ANALYZE"))
        events = conn.execute(sa.text("SELECT count(*) FROM orc_task_events")).scalar_one()
        open_tasks = conn.execute(sa.text("SELECT count(*) FROM orc_tasks WHERE state <> 'SUCCEEDED'")).scalar_one()
    print(f"built {made} tasks ({open_tasks} open), {events} ledger rows in {time.monotonic() - started:.1f}s")

    times = []
    size = 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        body, _ = metrics.render(orc)
        times.append(time.perf_counter() - t0)
        size = len(body)
    print(
        f"scrape: median {statistics.median(times) * 1000:.1f} ms, worst {max(times) * 1000:.1f} ms"
        f" over {args.repeat} ({size} bytes of metrics)"
    )
    with orc.store.engine.connect() as conn:
        plan = conn.execute(
            sa.text(
                "EXPLAIN ANALYZE SELECT state, queue, tenant, count(*), min(ready_at) FROM orc_tasks"
                " WHERE state IN ('DEAD_LETTER','PENDING','QUEUED','READY','RETRYING','RUNNING')"
                " GROUP BY state, queue, tenant"
            )
        ).scalars()
        print("open tasks by state, queue, tenant: " + next(line for line in plan if "Execution Time" in line).strip())
    orc.store.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
