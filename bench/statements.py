"""How many SQL statements the server runs per hot-path call: counted, not timed.

Run from the repository root, in the project's venv (it re-creates its database, whose name must
contain "bench", and flushes its Redis database)::

    python bench/statements.py [--width 3] [--map N] [--cpu N] [--database-url URL] [--redis-url URL] [--json]

It submits ``1 -> W -> 1`` no-ops (``W = --width``), registers one live worker (``-c 2``) on the
default queues, and then drives the tasks through the server functions itself, as a worker's
claims and successes would (no Celery worker runs): the root, every middle task (the first one,
a middle one, the last one, which makes the join READY) and the join; with ``--map N`` also a
map's source and its first, middle and last child (the header's counters are the join's). Each call runs with
``auto_explain`` at ``NOTICE`` level with nested statements on, so every statement the server
executes for it (inside the PL/pgSQL functions too) comes back to this process as one notice;
the script prints how many per call, with the functions they ran in, and how many ran while
the call held the row lock of the fan-in's join (its counters) and of the run (its open count):
a lock every completion of the fan-in, or of the run, waits for, held to the commit. The count depends on the
code and the DAG's shape, not on the machine's speed or load, so two releases compare exactly.

``--cpu N`` then does the same for a second run of ``1 -> N -> 1`` without ``auto_explain`` and
prints the CPU time the server process of its connection spent per middle task's claim and
success (``/proc``: CPU time, not wall time, so another process's load changes it little; the
commit's WAL flush is a wait, not CPU). Root (or the server's user) reads the server's ``/proc``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_stmts"
WORKER = "bench-statements@host"
#: the statements that write the two rows every completion of a fan-in (or of the run) writes
HOT_JOIN = re.compile(r"UPDATE orc_tasks t SET\s+(n_done = t\.n_done|map_done = t\.map_done) \+ 1")
HOT_RUN = re.compile(r"UPDATE orc_runs SET open_tasks = open_tasks -")
CLAIM = "SELECT orc_claim_v2(%s::text, %s::text, %s::int, %s::text, %s::float8, %s::text)"
SUCCEED = "SELECT orc_succeed_v2(%s::text, %s::text, %s::int, %s::json, %s::int, %s::float8, %s::int, %s::float8)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=3, help="middle tasks of the fan-out (default 3)")
    parser.add_argument("--database-url", default=DB, help="bench database (dropped and re-created!)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15", help="bench Redis database (flushed!)")
    parser.add_argument("--map", type=int, default=0, help="also: a map of N items (0: skip)")
    parser.add_argument(
        "--cpu", type=int, default=0, help="also: server CPU per claim + success over 1 -> N -> 1 (0: skip)"
    )
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    if args.width < 2:
        parser.error("--width must be at least 2")
    os.environ.update(
        ORCHESTRATOR_DATABASE_URL=args.database_url,
        ORCHESTRATOR_BROKER_URL=args.redis_url,
        ORCHESTRATOR_DATA_DIR=tempfile.mkdtemp(),
        ORCHESTRATOR_TASK_MODULES="tasks.probes,tasks.etl,bench.raw_tasks",
    )
    import psycopg
    import redis

    import bench.bench as b
    from orchestrator.core.routing import default_queues
    from orchestrator.engine.facade import Orchestrator
    from orchestrator.runtime.celery_app import get_app

    b.reset_database(args.database_url)
    redis.Redis.from_url(args.redis_url).flushdb()
    orc = Orchestrator(app=get_app())
    orc.store.workers.register(WORKER, default_queues(), 2)
    run = orc.submit(b.fanout_dag(args.width, "statements"))
    settings = orc.settings
    dsn = re.sub(r"^postgresql\+psycopg://", "postgresql://", args.database_url)
    notices: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("LOAD 'auto_explain'")
        for name, value in (
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.log_level", "notice"),
            ("auto_explain.log_format", "json"),
            ("client_min_messages", "notice"),
        ):
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))

        def counted(label: str, query: str, params: tuple[Any, ...]) -> Any:
            notices.clear()
            value = conn.execute(query, params).fetchone()
            texts = [_query_text(n) for n in notices]
            # the top-level statement is one of them: the rest ran inside the functions
            by_function = collections.Counter(_function_of(t) for t in texts)
            results[label] = {
                "statements": len(texts),
                "under_join_lock": _after(texts, HOT_JOIN),
                "under_run_lock": _after(texts, HOT_RUN),
                "by_kind": dict(by_function),
            }
            return value[0] if value else None

        def attempt(key: str) -> int:
            row = conn.execute("SELECT attempt FROM orc_tasks WHERE run_id = %s AND key = %s", (run.id, key)).fetchone()
            assert row is not None, key
            return int(row[0])

        def claim_and_succeed(
            key: str, label: str, a: int | None = None, task: str = b.NOOP, result: Any = None
        ) -> None:
            a = attempt(key) if a is None else a
            claimed = counted(f"claim {label}", CLAIM, (run.id, key, a, f"{WORKER}:1", 60.0, task))
            if not claimed or not claimed.get("accepted", True):
                raise SystemExit(f"the claim of {key} was refused: {claimed}")
            done = counted(
                f"succeed {label}",
                SUCCEED,
                (run.id, key, a, json.dumps(result), settings.dispatch_window, settings.worker_ttl,
                 settings.dispatch_depth, settings.priority_aging_seconds),
            )  # fmt: skip
            if not done.get("accepted"):
                raise SystemExit(f"the success of {key} was refused: {done}")

        mids = [f"m{i:05d}" for i in range(args.width)]
        claim_and_succeed("root", "root (makes the middle READY)")
        for i, key in enumerate(mids):
            label = (
                "first middle task"
                if i == 0
                else "last middle task (the join READY)"
                if i == len(mids) - 1
                else "a middle task"
                if i == len(mids) // 2
                else None
            )
            if label is None:
                claim_and_succeed(key, f"middle {i}")
                continue
            claim_and_succeed(key, label)
        claim_and_succeed("sink", "the join (closes the run)")
        if args.map:
            run = orc.submit(b.map_dag(args.map, "statements-map"))
            claim_and_succeed("source", "map source", task=b.LISTING, result=list(range(args.map)))
            kids = [
                r[0]
                for r in conn.execute(
                    "SELECT key FROM orc_tasks WHERE run_id = %s AND map_parent = 'm' ORDER BY map_index", (run.id,)
                )
            ]
            for i, key in enumerate(kids):
                label = {0: "map: first child", len(kids) // 2: "map: a child", len(kids) - 1: "map: last child"}
                claim_and_succeed(key, label.get(i, f"middle {i}"), task=b.MAP_ITEM)
        if args.cpu:
            conn.execute("SELECT set_config('auto_explain.log_min_duration', '-1', false)")
            run = orc.submit(b.fanout_dag(args.cpu, "statements-cpu"))
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            counted = _plain(conn)
            claim_and_succeed("root", "cpu root")
            before = _cpu(pid)
            for i in range(args.cpu):
                claim_and_succeed(f"m{i:05d}", "cpu middle", 1)  # a first attempt: nothing read
            per_task = (_cpu(pid) - before) / args.cpu * 1e6
            claim_and_succeed("sink", "cpu join")
            results["cpu"] = {"middle_tasks": args.cpu, "server_cpu_us_per_task": round(per_task, 1)}
    state = orc.store.runs.get(run.id).state if hasattr(orc.store, "runs") else None
    shown = {k: v for k, v in results.items() if not re.match(r"(claim|succeed) (middle \d+|cpu .*)$", k)}
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    for label, figures in shown.items():
        if label == "cpu":
            print(
                f"server CPU per middle task's claim + success over 1 -> {figures['middle_tasks']} -> 1:"
                f" {figures['server_cpu_us_per_task']:.0f} us"
            )
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(figures["by_kind"].items(), key=lambda kv: -kv[1]))
        locks = "".join(
            f", {figures[k]} under the {what} row's lock"
            for k, what in (("under_join_lock", "join"), ("under_run_lock", "run"))
            if figures.get(k) is not None
        )
        print(f"{label:45s} {figures['statements']:3d} statements{locks}  ({kinds})")
    if state is not None:
        print(f"run {run.id}: {state}")
    return 0


def _after(texts: list[str], hot: re.Pattern[str]) -> int | None:
    """How many statements ended after the first one matching ``hot`` (itself included), the
    call's own top-level statement left out: the statements run while that row is locked (a row
    lock is held to the commit). ``None`` when no statement wrote it. auto_explain reports a
    statement when it ends, so a function's call ends after its own statements."""
    for i, text in enumerate(texts):
        if hot.search(text):
            return len(texts) - i - 1
    return None


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _plain(conn: Any) -> Any:
    """A ``counted`` that only runs the call (the CPU pass: no notices)."""

    def run(label: str, query: str, params: tuple[Any, ...]) -> Any:
        value = conn.execute(query, params).fetchone()
        return value[0] if value else None

    return run


def _query_text(notice: str) -> str:
    """The statement text of one auto_explain notice (JSON format)."""
    try:
        body = json.loads(notice[notice.index("{") :])
    except ValueError:
        return notice
    return str(body.get("Query Text", ""))


def _function_of(text: str) -> str:
    """A short name for what a statement does: its first verb and table or function."""
    flat = " ".join(text.split())
    m = re.match(r"(?i)(select|update|insert into|delete from|with)\b.*?\b(orc_[a-z0-9_]+)", flat)
    if m:
        return f"{m.group(1).split()[0].upper()} {m.group(2)}"
    return flat[:30]


if __name__ == "__main__":
    sys.exit(main())
