"""Cancel latency of a busy wide run (issue 36, crossing 3): a 100,000-item map that real workers
are working through, cancelled through ``Orchestrator.cancel``.

    python bench/cancel.py [--items 100000] [--concurrency 4] [--done 500] [--repeat 2]
    python bench/cancel.py --cancel-from <commit>     # the same, with that commit's cancel

On its own database (``orchestrator_bench_cancel``, re-created) and Redis db 7 (flushed), with
one real worker (``celery -A config.celery_app worker -c --concurrency``, prefork): each round
submits ``ls -> m (--items children) -> join``, waits until ``--done`` children succeeded (the
worker is busy: its completions settle, count into the map's header and the run, and dispatch
the next child), then cancels the run and times the call. A cancel that raises (``deadlock
detected`` once the store's retries are spent) is timed and tried again, as an operator would.
Prints per round: the seconds to the first try's end, whether it succeeded, the tries, the
deadlock retries the store logged, the tasks cancelled and revoked; and the database's
``deadlocks`` counter (``pg_stat_database``) over the rounds.

``--cancel-from REV`` swaps in ``orchestrator/store/operator.py``'s ``cancel_run`` of ``REV``
(read with ``git show``), so a before/after comparison runs in one sitting on the same tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_cancel"
REDIS = "redis://127.0.0.1:6379/7"


class DeadlockCount(logging.Handler):
    """Counts the store's retries after ``DeadlockDetected`` (its warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Deadlock" in record.getMessage():
            self.n += 1


def use_cancel_from(rev: str) -> None:
    """Replace ``OperatorActions.cancel_run`` with the one of commit ``rev``."""
    from orchestrator.store import operator as current

    source = subprocess.run(
        ["git", "show", f"{rev}:orchestrator/store/operator.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="orc-bench-cancel-")) / "operator_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("orchestrator.store._operator_then", path)
    assert spec is not None and spec.loader is not None
    then = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(then)

    def cancel_run(self: Any, run_id: str, actor: Any) -> Any:
        out = then.OperatorActions.cancel_run(self, run_id, actor)
        return out if len(out) == 3 else current.Cancelled(out[0], out[1], False)

    current.OperatorActions.cancel_run = cancel_run  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000, help="the map's width (default 100,000)")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's -c (default 4)")
    parser.add_argument("--done", type=int, default=500, help="children succeeded before the cancel (default 500)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--max-tries", type=int, default=10, help="cancel calls per round at most (default 10)")
    parser.add_argument("--cancel-from", metavar="REV", help="time the cancel of this commit instead")
    a = parser.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="orc-bench-cancel-"))
    os.environ.update(
        {
            "ORCHESTRATOR_DATABASE_URL": DB,
            "ORCHESTRATOR_BROKER_URL": REDIS,
            "ORCHESTRATOR_DATA_DIR": str(data_dir),
            "ORCHESTRATOR_TASK_MODULES": "tasks.dynamic",
        }
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    import redis
    import sqlalchemy as sa

    from bench.bench import Worker, log, reset_database
    from orchestrator import DAG
    from orchestrator.core.routing import default_queues
    from orchestrator.engine.facade import Orchestrator

    if a.cancel_from:
        use_cancel_from(a.cancel_from)
        log(f"timing the cancel of {a.cancel_from}")
    deadlocks = DeadlockCount()
    logging.getLogger("orchestrator").addHandler(deadlocks)
    log(f"resetting {DB}; flushing {REDIS}")
    reset_database(DB)
    redis.Redis.from_url(REDIS).flushdb()
    worker = Worker(
        env=env, concurrency=a.concurrency, queues=",".join(default_queues()), logfile=data_dir / "worker.log"
    )
    worker.start()
    rows: list[dict[str, Any]] = []
    try:
        from orchestrator.runtime.celery_app import get_app

        orc = Orchestrator(app=get_app())
        engine = orc.store.engine

        def scalar(sql: str, **params: Any) -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.text(sql), params).scalar_one())

        db_deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        before = scalar(db_deadlocks)
        for i in range(a.repeat):
            dag = DAG(f"cancel-bench-{i}")
            ls = dag.task("ls", "tasks.dynamic.listing", kwargs={"n": a.items})
            m = dag.map("m", "tasks.dynamic.item", over=ls, kwarg="x", max_map_length=a.items)
            dag.task("join", "tasks.dynamic.collect", upstream=[m])
            run = orc.submit(dag)
            deadline = time.monotonic() + 600
            done = "SELECT count(*) FROM orc_tasks WHERE run_id = :r AND map_parent = 'm' AND state = 'SUCCEEDED'"
            while scalar(done, r=run.id) < a.done:
                worker.check_alive()
                if time.monotonic() > deadline:
                    raise SystemExit(f"round {i}: fewer than {a.done} children done after 600 s")
                time.sleep(0.2)
            open_rows = scalar(
                "SELECT count(*) FROM orc_tasks WHERE run_id = :r AND state NOT IN"
                " ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED', 'CANCELLED')",
                r=run.id,
            )
            retries_before, tries = deadlocks.n, 0
            first: tuple[float, bool] | None = None
            began = time.perf_counter()
            while True:
                tries += 1
                t0 = time.perf_counter()
                try:
                    revoked = orc.cancel(run.id, by="bench")
                except Exception as exc:  # the figure: a cancel that fails
                    log(f"round {i}: try {tries} failed after {time.perf_counter() - t0:.1f}s: {exc!s:.120}")
                    first = first if first is not None else (time.perf_counter() - t0, False)
                    if tries >= a.max_tries:
                        raise SystemExit(f"round {i}: the cancel failed {tries} times") from exc
                    continue
                first = first if first is not None else (time.perf_counter() - t0, True)
                break
            total = time.perf_counter() - began
            assert first is not None
            row = {
                "round": i,
                "open_rows": open_rows,
                "first_try_s": round(first[0], 2),
                "first_try_ok": first[1],
                "tries": tries,
                "total_s": round(total, 2),
                "deadlock_retries": deadlocks.n - retries_before,
                "revoked": revoked,
                "state": run.state.value,
            }
            rows.append(row)
            log(f"round {i}: {row}")
        # the counter is read once every session that may have counted one has closed (a
        # session's statistics are flushed when it ends)
        worker.stop()
        orc.store.dispose()
        time.sleep(1.0)
        after = scalar(db_deadlocks)
    finally:
        worker.stop()
    print(f"cancel of a busy {a.items}-item map, worker -c {a.concurrency}, cancel from {a.cancel_from or 'this tree'}")
    print("round  open rows  first try (s)  first ok  tries  total (s)  deadlock retries  revoked  state")
    for r in rows:
        print(
            f"{r['round']:5d}  {r['open_rows']:9d}  {r['first_try_s']:13.2f}  {r['first_try_ok']!s:>8}"
            f"  {r['tries']:5d}  {r['total_s']:9.2f}  {r['deadlock_retries']:16d}  {r['revoked']:7d}  {r['state']}"
        )
    print(f"pg_stat_database deadlocks over the rounds: {after - before}")


if __name__ == "__main__":
    main()
