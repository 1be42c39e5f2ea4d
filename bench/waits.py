"""Benchmark of waits and events (issue 20) on one real Celery worker, Redis and Postgres.

Run from the repository root::

    python bench/waits.py [--waits 10000] [--races 10000] [--sleeps 1000] [--json]

It measures, in one run (see "Waits and events (issue 20)" in bench/README.md):

1. ``--waits`` wait nodes (``dag.wait(f"w{i}", event="bench.evt", match={"i": i})``, or
   ``event=f"bench.evt.{i}"`` with ``--distinct-keys``), each followed by a no-op task, in
   ``--runs`` run(s), waiting while a second, ordinary DAG (a 1 -> ``--side-n`` -> 1 fan-out)
   runs beside them on the worker's slots, against the same DAG alone (alone before the
   submit, beside, beside, alone after the emits; the orc_* tables VACUUMed before each); then
   one emit per wait (distinct event ids: the first ``--paced`` at ``--paced-rate`` per
   second, the rest as fast as one thread emits), until the runs are final: emit (the event's
   ``emitted_at``) -> the follow-up task's QUEUED -> RUNNING ledger row, p50 / p99, and the
   total time;
2. ``--races`` emit / wait pairs with no worker, in a database of their own: a run whose root
   waits for event k and an emit of k, in five orders (wait then emit, emit then wait, both
   released by a barrier, then the submit up to 10 ms later or the emit up to 30 ms later,
   and both blocked on the key's advisory lock held by a third connection, queued emit first
   or wait first); from the database, waits missed (not SUCCEEDED once both are done) and
   woken twice;
3. ``--sleeps`` wait nodes sleeping until the same instant (``until``, a few seconds ahead),
   each followed by a no-op task, woken by the worker's reconciler (``--tick`` seconds between
   passes): the instant -> each wait's WAITING -> SUCCEEDED ledger row, and -> each follow-up's
   start.

The bench databases (``<db>`` and ``<db>_race``; the name must contain "bench") are dropped
and re-created, and the Redis database is flushed, at the start of every run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
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

from bench.bench import (  # noqa: E402
    NOOP,
    TASK_MODULES,
    Bench,
    BenchError,
    Worker,
    derived_url,
    fanout_dag,
    log,
    percentile,
    reset_database,
    sigterm_as_exit,
)

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_waits"
DEFAULT_REDIS = "redis://127.0.0.1:6379/12"
EVENT = "bench.evt"
RACE_EVENT = "bench.race"
#: the orders of an emit / wait pair (the race scenario)
ORDERS = ("wait-then-emit", "emit-then-wait", "barrier", "lock:emit-queued-first", "lock:wait-queued-first")


def ms_summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min_ms": min(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "max_ms": max(values),
        "mean_ms": statistics.fmean(values),
    }


def event_key(i: int, distinct: bool) -> str:
    return f"{EVENT}.{i}" if distinct else EVENT


def waits_dag(items: range, name: str, distinct: bool = False) -> Any:
    """A wait node for each of ``items`` on one event key (``distinct``: each on its own), each
    matching its own payload, each -> a no-op."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    for i in items:
        w = dag.wait(f"w{i:05d}", event=event_key(i, distinct), match={"i": i})
        dag.task(f"t{i:05d}", NOOP, upstream=[w])
    return dag


def sleeps_dag(n: int, name: str, until: dt.datetime) -> Any:
    """``n`` wait nodes sleeping until ``until``, each -> a no-op."""
    from orchestrator.core.dag import DAG

    dag = DAG(name)
    for i in range(n):
        w = dag.wait(f"s{i:05d}", until=until)
        dag.task(f"t{i:05d}", NOOP, upstream=[w])
    return dag


class WaitsBench:
    def __init__(self, args: argparse.Namespace, base: Bench) -> None:
        self.args = args
        self.base = base
        self.results: dict[str, Any] = {}

    @property
    def orc(self) -> Any:
        return self.base.orchestrator()

    def query(self, sql: str, **params: Any) -> list[Any]:
        import sqlalchemy as sa

        with self.orc.store.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params).all())

    def starts(self, run_ids: list[str]) -> dict[str, dt.datetime]:
        """Each task's first accepted QUEUED -> RUNNING ledger row (its start) of the runs."""
        rows = self.query(
            "select key, min(at) from orc_task_events where run_id = any(:r) and from_state = 'QUEUED'"
            " and to_state = 'RUNNING' and accepted group by key",
            r=run_ids,
        )
        return {k: at for k, at in rows}

    # ------------------------------------------------------------ 1. event waits

    def vacuum(self) -> None:
        """VACUUM the orc_* tables (as autovacuum would; the bench server runs with it off), so
        that the side DAG's runs are not told apart by the dead rows the phases before left."""
        import sqlalchemy as sa

        with self.orc.store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            tables = conn.execute(sa.text("select tablename from pg_tables where tablename like 'orc_%'")).scalars()
            for table in list(tables):
                conn.exec_driver_sql(f'VACUUM "{table}"')

    def side_run(self, label: str) -> float:
        n = self.args.side_n
        if not self.args.no_vacuum:
            self.vacuum()
        _, took = self.base.run_dag(fanout_dag(n, f"waits_side_{label}"))
        log(f"side DAG 1->{n}->1 ({label}): {took:.3f}s = {n / took:.1f} tasks/s")
        return took

    def bench_events(self) -> None:
        n, args, orc = self.args.waits, self.args, self.orc
        alone = [self.side_run("alone-1")]
        t0 = time.perf_counter()
        step = -(-n // args.runs)
        runs = [
            orc.submit(waits_dag(range(lo, min(lo + step, n)), "waits_events", args.distinct_keys))
            for lo in range(0, n, step)
        ]
        ids = [run.id for run in runs]
        submit_s = time.perf_counter() - t0
        counts = dict(self.query("select state, count(*) from orc_tasks where run_id = any(:r) group by state", r=ids))
        if counts.get("WAITING", 0) != n:
            raise BenchError(f"expected {n} WAITING after the submit, got {counts}")
        log(f"{n} waits submitted in {submit_s:.3f}s ({len(runs)} run(s), 2 x {n} nodes); states {counts}")
        busy = self.query(
            "select count(*) from orc_tasks where run_id = any(:r) and state in ('QUEUED', 'RUNNING')", r=ids
        )[0][0]
        beside = [self.side_run("beside-1"), self.side_run("beside-2")]
        still = self.query("select count(*) from orc_tasks where run_id = any(:r) and state = 'WAITING'", r=ids)[0][0]
        # the emits: the first --paced at --paced-rate per second, the rest as fast as one thread goes
        emit_ms: list[float] = []
        paced = min(args.paced, n)
        first_emit = time.perf_counter()
        for i in range(n):
            if i < paced and args.paced_rate > 0:
                due = first_emit + i / args.paced_rate
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            if i == paced:
                burst_start = time.perf_counter()
            t = time.perf_counter()
            done = orc.events.emit(event_key(i, args.distinct_keys), {"i": i}, event_id=f"e{i:05d}")
            emit_ms.append((time.perf_counter() - t) * 1000.0)
            if done.woken != 1:
                raise BenchError(f"emit {i} woke {done.woken} waits, expected 1")
        emitted = time.perf_counter()
        for run in runs:
            view = run.wait(max(args.timeout, n / 50.0), poll=0.05)
            if view.state.value != "SUCCEEDED":
                raise BenchError(f"run {run.id} ended {view.state.value}: {view.counts}")
        finished = time.perf_counter()
        log(f"{n} emits in {emitted - first_emit:.3f}s; run final {finished - first_emit:.3f}s after the first emit")
        alone.append(self.side_run("alone-2"))  # after the emits: nothing waits any more

        emitted_at = {
            f"t{int(i):05d}": at
            for i, at in self.query("select payload->>'i', emitted_at from orc_events where event_id like 'e%'")
        }
        starts = self.starts(ids)
        lat = {k: (starts[k] - emitted_at[k]).total_seconds() * 1000.0 for k in emitted_at}
        paced_keys = [f"t{i:05d}" for i in range(paced)]
        burst_keys = [f"t{i:05d}" for i in range(paced, n)]
        woken_rows = self.query(
            "select count(*), count(distinct key) from orc_task_events where run_id = any(:r)"
            " and from_state = 'WAITING' and to_state = 'SUCCEEDED' and accepted",
            r=ids,
        )[0]
        span = self.query(
            "select extract(epoch from (select max(finished_at) from orc_runs where id = any(:r))"
            " - (select min(emitted_at) from orc_events where event_id like 'e%'))",
            r=ids,
        )[0][0]
        alone_s = statistics.fmean(alone)
        beside_s = statistics.fmean(beside)
        side_n = args.side_n
        self.results["events"] = {
            "run_ids": ids,
            "waits": n,
            "distinct_keys": args.distinct_keys,
            "submit_s": submit_s,
            "in_flight_while_waiting": busy,
            "waiting_after_side_runs": still,
            "side_n": side_n,
            "side_alone_s": alone,
            "side_beside_s": beside,
            "side_alone_tasks_per_s": side_n / alone_s,
            "side_beside_tasks_per_s": side_n / beside_s,
            "beside_over_alone": alone_s / beside_s,
            "paced": paced,
            "paced_rate": args.paced_rate,
            "emit_call": ms_summary(emit_ms),
            "emit_call_burst": ms_summary(emit_ms[paced:]) if n > paced else None,
            "emits_s": emitted - first_emit,
            "burst_emits_per_s": (n - paced) / (emitted - burst_start) if n > paced else None,
            "first_emit_to_final_s": finished - first_emit,
            "db_first_emit_to_final_s": float(span),
            "latency_all": ms_summary(list(lat.values())),
            "latency_paced": ms_summary([lat[k] for k in paced_keys]) if paced_keys else None,
            "latency_burst": ms_summary([lat[k] for k in burst_keys]) if burst_keys else None,
            "woken_ledger_rows": woken_rows[0],
            "woken_tasks": woken_rows[1],
        }

    # ------------------------------------------------------------ 3. sleeps due together

    def bench_sleeps(self) -> None:
        n, orc = self.args.sleeps, self.orc
        db_now = self.query("select now()")[0][0]
        until = (db_now + dt.timedelta(seconds=self.args.sleep_ahead)).replace(microsecond=0)
        t0 = time.perf_counter()
        run = orc.submit(sleeps_dag(n, "waits_sleeps", until))
        submit_s = time.perf_counter() - t0
        view = run.wait(self.args.timeout, poll=0.05)
        if view.state.value != "SUCCEEDED":
            raise BenchError(f"run {run.id} ended {view.state.value}: {view.counts}")
        woke = self.query(
            "select key, at, actor from orc_task_events where run_id = :r and from_state = 'WAITING'"
            " and to_state = 'SUCCEEDED' and accepted",
            r=run.id,
        )
        waited = self.query(
            "select count(*) from orc_task_events where run_id = :r and to_state = 'WAITING' and accepted", r=run.id
        )[0][0]
        wake_ms = [(at - until).total_seconds() * 1000.0 for _, at, _ in woke]
        passes = Counter(at for _, at, _ in woke)
        starts = self.starts([run.id])
        start_ms = [(at - until).total_seconds() * 1000.0 for k, at in starts.items() if k.startswith("t")]
        last_finish = self.query(
            "select extract(epoch from max(finished_at) - :u) from orc_tasks where run_id = :r and key like 't%'",
            r=run.id,
            u=until,
        )[0][0]
        self.results["sleeps"] = {
            "run_id": run.id,
            "sleeps": n,
            "tick_s": self.args.tick,
            "until": until.isoformat(),
            "ahead_s": self.args.sleep_ahead,
            "submit_s": submit_s,
            "began_waiting": waited,
            "woken": len(woke),
            "woken_by": dict(Counter(a for _, _, a in woke)),
            "wake_passes": len(passes),
            "wake_after_instant": ms_summary(wake_ms),
            "follow_up_start_after_instant": ms_summary(start_ms),
            "last_follow_up_finished_after_instant_s": float(last_finish),
        }
        log(
            f"{n} sleeps: woken {min(wake_ms):.0f}-{max(wake_ms):.0f} ms after the instant in {len(passes)} pass(es);"
            f" follow-ups started {min(start_ms):.0f}-{max(start_ms):.0f} ms after it"
        )

    # ------------------------------------------------------------ 2. races (no worker)

    def bench_races(self, url: str, app: Any) -> None:
        import sqlalchemy as sa

        from orchestrator.core.config import Settings
        from orchestrator.core.dag import DAG, dag_from_spec
        from orchestrator.engine.facade import Orchestrator

        pairs, lanes = self.args.races, self.args.lanes
        orc = Orchestrator(Settings.from_env(database_url=url), app=app)
        template = DAG("race")
        template.wait("w", event=RACE_EVENT, match={"k": 0})
        base_spec = template.to_spec()
        holder_engine = sa.create_engine(url, pool_size=2 * lanes + 1)
        runs: dict[int, tuple[str, str]] = {}  # k -> (order, run id)
        errors: list[str] = []
        blocked_sql = sa.text(
            "select count(*) from pg_locks where locktype = 'advisory' and not granted and objsubid = 2"
            " and classid::bigint = (hashtext('orc-event:default')::bigint & 4294967295)"  # orc_event_lock_v1
            " and objid::bigint = (hashtextextended(:lk, 0) & 255)"
        )

        def dag_for(k: int, key: str) -> Any:
            spec = json.loads(json.dumps(base_spec))
            spec["nodes"][0]["wait"]["match"] = {"k": k}
            spec["nodes"][0]["wait"]["event"] = key
            return dag_from_spec(spec)

        def submit(k: int, key: str, order: str) -> None:
            runs[k] = (order, orc.submit(dag_for(k, key)).id)

        def emit(k: int, key: str) -> None:
            orc.events.emit(key, {"k": k}, event_id=f"r{k:06d}")

        def guarded(fn: Any, *a: Any) -> None:
            try:
                fn(*a)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

        def pair(k: int, lane: int, order: str) -> None:
            key = f"{RACE_EVENT}.{lane}"
            if order == "wait-then-emit":
                submit(k, key, order)
                emit(k, key)
            elif order == "emit-then-wait":
                emit(k, key)
                submit(k, key, order)
            elif order == "barrier":
                # released together, then the submit waits up to 10 ms or the emit up to 30 ms (by
                # k; a submit takes about 10-20 ms), so that the emit lands before, inside and
                # after the submit's transaction
                barrier, offset = threading.Barrier(2), ((k // lanes // len(ORDERS)) % 41 - 10) * 0.001

                def after_barrier(pause: float, fn: Any, *a: Any) -> None:
                    barrier.wait()
                    time.sleep(pause)
                    guarded(fn, *a)

                ths = [
                    threading.Thread(target=after_barrier, args=(max(-offset, 0), submit, k, key, order)),
                    threading.Thread(target=after_barrier, args=(max(offset, 0), emit, k, key)),
                ]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join(60)
            else:
                lock_key = key
                first_emit = order == "lock:emit-queued-first"
                jobs = [lambda: guarded(emit, k, key), lambda: guarded(submit, k, key, order)]
                if not first_emit:
                    jobs.reverse()
                with holder_engine.connect() as holder:
                    # the key's lock, as orc_emit_v1 and orc_wait_v1 take it (orc_event_lock_v1)
                    holder.execute(sa.text("select orc_event_lock_v1('default', :key)"), {"key": key})
                    ths = []
                    for queued, job in enumerate(jobs, start=1):
                        th = threading.Thread(target=job)
                        th.start()
                        ths.append(th)
                        deadline = time.monotonic() + 30
                        with holder_engine.connect() as probe:
                            while probe.execute(blocked_sql, {"lk": lock_key}).scalar_one() < queued:
                                if time.monotonic() > deadline:
                                    raise BenchError(f"pair {k}: nobody queued on the lock of {key}")
                                time.sleep(0.0005)
                    holder.commit()  # releases the lock: the queue is granted in its order
                for th in ths:
                    th.join(60)

        def lane_main(lane: int) -> None:
            try:
                for k in range(lane, pairs, lanes):
                    pair(k, lane, ORDERS[(k // lanes) % len(ORDERS)])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"lane {lane}: {type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=lane_main, args=(lane,)) for lane in range(lanes)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        took = time.perf_counter() - t0
        holder_engine.dispose()
        if errors:
            raise BenchError(f"{len(errors)} errors in the race, first: {errors[0]}")
        with orc.store.engine.connect() as conn:
            state: dict[str, str] = {
                r: st for r, st in conn.execute(sa.text("select run_id, state from orc_tasks where key = 'w'")).all()
            }
            accepted = Counter(
                {
                    r: c
                    for r, c in conn.execute(
                        sa.text(
                            "select run_id, count(*) from orc_task_events where key = 'w' and to_state = 'SUCCEEDED'"
                            " and accepted group by run_id"
                        )
                    ).all()
                }
            )
            how: dict[str, str] = {
                r: st
                for r, st in conn.execute(
                    sa.text(
                        "select run_id, from_state from orc_task_events where key = 'w' and to_state = 'SUCCEEDED'"
                        " and accepted"
                    )
                ).all()
            }
            rejected = conn.execute(
                sa.text("select count(*) from orc_task_events where key = 'w' and not accepted")
            ).scalar_one()
            woke_sum, events = conn.execute(sa.text("select coalesce(sum(woke), 0), count(*) from orc_events")).one()
        per_order: dict[str, Counter[str]] = {o: Counter() for o in ORDERS}
        for _k, (order, run_id) in runs.items():
            c = per_order[order]
            c["pairs"] += 1
            if state.get(run_id) != "SUCCEEDED":
                c["missed"] += 1
            if accepted[run_id] > 1:
                c["woken_twice"] += 1
            c["woken_by_emit" if how.get(run_id) == "WAITING" else "found_by_lookback"] += 1
        missed = sum(c["missed"] for c in per_order.values())
        twice = sum(c["woken_twice"] for c in per_order.values())
        self.results["races"] = {
            "pairs": pairs,
            "runs": len(runs),
            "lanes": lanes,
            "elapsed_s": took,
            "missed": missed,
            "woken_twice": twice,
            "events": events,
            "events_woke_sum": int(woke_sum),
            "rejected_ledger_rows": rejected,
            "per_order": {o: dict(c) for o, c in per_order.items()},
        }
        log(f"races: {len(runs)} pairs in {took:.1f}s, missed {missed}, woken twice {twice}, woke sum {woke_sum}")
        orc.store.dispose()


# ---------------------------------------------------------------------------- report


def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    out: list[str] = [
        "",
        f"Waits and events (issue 20): worker -c {meta['concurrency']} prefork on {meta['cpus']} CPUs,"
        f" Celery {meta['celery']}, Python {meta['python']}",
        f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"
        " (other processes on the machine skew every figure)",
    ]
    raw = results.get("raw")
    if raw:
        out.append(f"raw Celery no-op x{raw['tasks']}: {raw['tasks_per_s']:.1f} tasks/s (context)")
    ev = results.get("events")
    if ev:
        side = ev["side_n"]
        lat = ev["latency_all"]
        out += [
            "",
            f"1. {ev['waits']} wait nodes ({'each on its own event key' if ev['distinct_keys'] else 'one event key'},"
            " match {'i': i}), each -> a no-op,"
            f" in {len(ev['run_ids'])} run(s)",
            f"   submit of {2 * ev['waits']} nodes: {ev['submit_s']:.3f}s; tasks of the run QUEUED/RUNNING while they"
            f" wait: {ev['in_flight_while_waiting']};"
            f" still WAITING after the side runs: {ev['waiting_after_side_runs']}",
            f"   side DAG 1->{side}->1 alone: {ev['side_alone_tasks_per_s']:.1f} tasks/s"
            f" (runs {', '.join(f'{s:.3f}' for s in ev['side_alone_s'])} s: before the submit, after the emits)",
            f"   side DAG beside the {ev['waits']} waits: {ev['side_beside_tasks_per_s']:.1f} tasks/s"
            f" (runs {', '.join(f'{s:.3f}' for s in ev['side_beside_s'])} s)",
            f"   beside / alone throughput (means of the two runs of each): {ev['beside_over_alone']:.3f}",
            f"   emits: {ev['waits']} in {ev['emits_s']:.2f}s ({ev['paced']} paced at {ev['paced_rate']:g}/s, the rest"
            + (f" at {ev['burst_emits_per_s']:.0f}/s from one thread)" if ev["burst_emits_per_s"] else ")"),
            f"   emit call (client, each waking 1 of the waiting): p50 {ev['emit_call']['p50_ms']:.2f} ms,"
            f" p99 {ev['emit_call']['p99_ms']:.2f} ms",
            f"   first emit -> run final: {ev['first_emit_to_final_s']:.2f}s"
            f" (database: first emitted_at -> run finished_at {ev['db_first_emit_to_final_s']:.2f}s)",
            f"   emit -> follow-up start, all {lat['n']}: p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms,"
            f" max {lat['max_ms']:.1f} ms",
        ]
        for name in ("paced", "burst"):
            part = ev[f"latency_{name}"]
            if part:
                out.append(
                    f"     {name} ({part['n']}): p50 {part['p50_ms']:.1f} ms, p99 {part['p99_ms']:.1f} ms,"
                    f" max {part['max_ms']:.1f} ms"
                )
        out.append(f"   WAITING -> SUCCEEDED ledger rows: {ev['woken_ledger_rows']} for {ev['woken_tasks']} tasks")
    rc = results.get("races")
    if rc:
        out += [
            "",
            f"2. {rc['pairs']} emit / wait pairs ({rc['lanes']} lanes in parallel, no worker): {rc['elapsed_s']:.1f}s",
            f"   missed (wait not SUCCEEDED after its event): {rc['missed']}   woken twice: {rc['woken_twice']}",
            f"   events {rc['events']}, sum of events.woke {rc['events_woke_sum']} (<= pairs),"
            f" rejected ledger rows {rc['rejected_ledger_rows']}",
        ]
        for order, c in rc["per_order"].items():
            out.append(
                f"   {order:24s} pairs {c.get('pairs', 0):5d}  missed {c.get('missed', 0)}  twice"
                f" {c.get('woken_twice', 0)}  woken by emit {c.get('woken_by_emit', 0):5d}  found by lookback"
                f" {c.get('found_by_lookback', 0):5d}"
            )
    sl = results.get("sleeps")
    if sl:
        w, f = sl["wake_after_instant"], sl["follow_up_start_after_instant"]
        out += [
            "",
            f"3. {sl['sleeps']} sleeps until the same instant ({sl['ahead_s']:g}s ahead), reconciler tick"
            f" {sl['tick_s']:g}s",
            f"   began waiting {sl['began_waiting']}, woken {sl['woken']} by {sl['woken_by']} in"
            f" {sl['wake_passes']} pass(es)",
            f"   instant -> WAITING->SUCCEEDED: min {w['min_ms']:.0f} ms, p50 {w['p50_ms']:.0f} ms, max"
            f" {w['max_ms']:.0f} ms (max - min {w['max_ms'] - w['min_ms']:.0f} ms)",
            f"   instant -> follow-up start: min {f['min_ms']:.0f} ms, p50 {f['p50_ms']:.0f} ms, p99"
            f" {f['p99_ms']:.0f} ms, max {f['max_ms']:.0f} ms; last follow-up finished"
            f" {sl['last_follow_up_finished_after_instant_s']:.2f}s after the instant",
        ]
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork), default 2")
    p.add_argument("--waits", type=int, default=10_000, help="event waits (scenario 1), default 10000, 0 skips it")
    p.add_argument(
        "--distinct-keys",
        action="store_true",
        help=f"each wait on its own event key ({EVENT}.<i>) instead of one key and a match",
    )
    p.add_argument("--runs", type=int, default=1, help="runs the --waits are split over, default 1")
    p.add_argument("--side-n", type=int, default=2000, help="middle tasks of the side fan-out, default 2000")
    p.add_argument("--paced", type=int, default=500, help="emits sent at --paced-rate first, default 500")
    p.add_argument("--paced-rate", type=float, default=20.0, help="paced emits per second, default 20")
    p.add_argument("--races", type=int, default=10_000, help="emit / wait pairs (scenario 2), default 10000, 0 skips")
    p.add_argument("--lanes", type=int, default=4, help="race pairs in flight at once, default 4")
    p.add_argument("--sleeps", type=int, default=1000, help="sleeps due together (scenario 3), default 1000, 0 skips")
    p.add_argument("--sleep-ahead", type=float, default=5.0, help="seconds from the submit to the instant, default 5")
    p.add_argument("--tick", type=float, default=1.0, help="the worker's reconciler tick (seconds), default 1")
    p.add_argument(
        "--no-vacuum", action="store_true", help="do not VACUUM the orc_* tables before each run of the side DAG"
    )
    p.add_argument("--raw-tasks", type=int, default=2000, help="raw Celery no-ops for context, default 2000 (0 skips)")
    p.add_argument("--database-url", default=DEFAULT_DB, help=f"bench database (re-created!), default {DEFAULT_DB}")
    p.add_argument("--redis-url", default=DEFAULT_REDIS, help=f"Redis database (flushed!), default {DEFAULT_REDIS}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each phase may take, default 300")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object (last line)")
    args = p.parse_args(argv)
    if min(args.concurrency, args.side_n, args.lanes, args.runs) < 1:
        p.error("--concurrency, --side-n, --lanes and --runs must be at least 1")
    if not 0 <= args.waits <= 99_999 or not 0 <= args.sleeps <= 99_999:
        p.error("--waits and --sleeps must be 0 to 99999")
    if not args.redis_url.startswith("redis://"):
        p.error("--redis-url must be redis://host:port/db")
    args.planner_stats = "none"  # what bench.Bench reads
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="orc-bench-waits-"))
    os.environ.update(
        {
            "ORCHESTRATOR_DATABASE_URL": args.database_url,
            "ORCHESTRATOR_BROKER_URL": args.redis_url,
            "ORCHESTRATOR_DATA_DIR": str(data_dir),
            "ORCHESTRATOR_TASK_MODULES": TASK_MODULES,
            "ORCHESTRATOR_TICK_SECONDS": str(args.tick),
        }
    )
    worker_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    import celery
    import redis

    from orchestrator.core.errors import OrchestratorError
    from orchestrator.core.routing import default_queues
    from orchestrator.runtime.celery_app import get_app

    race_url = derived_url(args.database_url, "_race")
    log(f"resetting {args.database_url} and {race_url}; flushing {args.redis_url}")
    reset_database(args.database_url)
    if args.races > 0:
        reset_database(race_url)
    r = redis.Redis.from_url(args.redis_url)
    r.flushdb()
    app = get_app()
    app.loader.import_default_modules()
    worker = Worker(
        env=worker_env, concurrency=args.concurrency, queues=",".join(default_queues()), logfile=data_dir / "worker.log"
    )
    base = Bench(args, worker, r)
    bench = WaitsBench(args, base)
    meta: dict[str, Any] = {
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "celery": celery.__version__,
        "python": platform.python_version(),
        "database": args.database_url,
        "race_database": race_url,
        "broker": args.redis_url,
        "tick_s": args.tick,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    ok = False
    started = time.perf_counter()
    with sigterm_as_exit():
        try:
            if args.waits > 0 or args.sleeps > 0:
                worker.start()
                base.send_raw(20 * args.concurrency)
                base.run_dag(fanout_dag(10 * args.concurrency, "waits_warmup"))
                if args.raw_tasks > 0:
                    base.bench_raw()
                    bench.results["raw"] = base.results["raw"]
                if args.waits > 0:
                    bench.bench_events()
                if args.sleeps > 0:
                    bench.bench_sleeps()
                worker.stop()
            if args.races > 0:
                bench.bench_races(race_url, app)
            ok = True
        except (BenchError, OrchestratorError) as exc:
            log(f"FAILED: {type(exc).__name__}: {exc}")
        except KeyboardInterrupt:
            log("interrupted")
        finally:
            if worker.proc is not None and not ok:
                log(f"worker log tail:\n{worker.log_tail()}")
            worker.stop()
            with contextlib.suppress(Exception):
                r.flushdb()
            with contextlib.suppress(Exception):
                base.orchestrator().store.dispose()
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
