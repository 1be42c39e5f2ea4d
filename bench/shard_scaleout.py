"""The sharded reconciler (issue 35) in network namespaces: 1, 2, 4 and 8 reconciler instances,
each on a simulated host of its own behind a delaying proxy, beside celery workers doing real tasks.

Run from the repository root, as root (it makes network namespaces), in the project's venv::

    python bench/shard_scaleout.py [--instances 1,2,4,8] [--rtt-ms 1.0] [--worker-hosts 2] [--slots 8]
                                   [--fanout 2000] [--retries 1000] [--trials 3] [--lease 2] [--tick 0.5]
                                   [--fairness-at 1,4] [--weights 1:1,3:1] [--fairness-tasks 400] [--json]

The hosts are those of ``bench/scaleout.py`` (a namespace ``orcb<i>``, a veth pair, a delaying
proxy per host in the root namespace: its docstring). Hosts 1..``--worker-hosts`` run a celery
worker each (``-P threads -c --slots``, its reconciler service off:
``ORCHESTRATOR_WORKER_RECONCILER=0``); each of the next hosts runs one ``python -m
orchestrator.cli reconcile --name rec-<j>`` with ``ORCHESTRATOR_RECONCILER_SHARDS=64``, so the
reconcilers are the N instances and nothing else. This process submits and reads straight to
Postgres. For each N of ``--instances``, on emptied tables and a flushed Redis database, with
fresh workers and N fresh instances (after a warm-up fan-out):

- **idle**: ``--idle-seconds`` with nothing to do: Postgres CPU per second (the instances'
  passes, the workers' heartbeats) and the instances' round trips per second;
- **fan-out**: 1 -> ``--fanout`` no-ops -> 1 with the instances on: end-to-end tasks/s (middle
  tasks over submit -> run final), Postgres CPU per task (the backends of the bench database,
  ``/proc``, read with the sessions: the server may be shared with other databases' work; the
  whole server's, the sampler's backend taken off, is in the details), round trips per task
  (workers', instances'), and the time held in serialised sections per task, sampled at
  ``--hz`` (bench/locks.py's way): the advisory locks of ``pg_locks`` (the admission locks;
  the duty lock is not taken in the sharded mode) and the shard rows locked (``pgrowlocks`` on
  ``orc_shards``: the fence's ``FOR SHARE``, the claims' and renewals' updates). 1 / held per
  task is the ceiling a section puts on the deployment;
- **fairness** (N in ``--fairness-at``): tenants A and B submit ``--fairness-tasks`` no-ops each
  at once, weights ``--weights``; B's share of the admissions while both had READY work against
  its weight (B behind: positive);
- **actions**: ``--retries`` one-task runs made due at once (bench/shards.py's way: RETRYING by
  an UPDATE, the task held READY afterwards, no worker registers it): due retries released per
  second, by the database's clock (up to a tick's wait included), and the server's and the
  instances' CPU per release (the server's beyond its idle rate);
- **failover** (N >= 2): ``--trials`` times the owner of shard 0 killed -9, retries due in its
  shards: the time from the kill until the last is released (p50, p99) against the lease;
- **ledger**: releases applied twice (must be 0) and writes refused for a stale shard epoch;
  **sessions**: the peak of server sessions per instance (``application_name`` = its host) and
  in total, sampled with the locks.

Everything it starts runs in its own process group and is stopped in ``finally`` blocks; the
namespaces and veths are deleted likewise, and leftovers of an interrupted run are removed at
start. Its database's name must contain ``shardscale`` (and ``scaleout``: it is emptied by
scale-out's code); created when missing. The machine has 2 shared cores: counts and CPU per task
are the measure, rates depend on the load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import locks as lk  # noqa: E402
from bench import scaleout as so  # noqa: E402
from bench import shards as sh  # noqa: E402
from bench.bench import BenchError, sigterm_as_exit  # noqa: E402

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_shardscaleout"
DEFAULT_REDIS = "redis://127.0.0.1:6379/13"
TENANTS = ("shardscale-a", "shardscale-b")
SHARD_ROWS = "SELECT s.shard FROM orc_shards s JOIN pgrowlocks('orc_shards') l ON s.ctid = l.locked_row"
SESSIONS = (
    "SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND backend_type = 'client backend' GROUP BY 1"
)
#: the server processes working for the bench database (not this sampler's own backend)
BACKENDS = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"


def log(msg: str) -> None:
    print(f"[shard-scaleout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Sections(lk.Sampler):
    """bench/locks.py's sampler of the advisory locks, plus the shard rows locked (pgrowlocks)
    and, every ``session_every`` samples, the server sessions per ``application_name`` and the
    CPU of the database's other backends (``/proc``). Its own backend's CPU is read before it
    closes (to be taken off the whole server's)."""

    def __init__(self, url: str, hz: float, shard_rows: bool, session_every: int = 10) -> None:
        super().__init__(url, hz)
        self.shard_rows = shard_rows
        self.session_every = session_every
        self.shards: Counter[int] = Counter()
        self.sessions: dict[str, int] = {}
        self.backend = int(self.conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        self.backend_cpu = 0.0
        #: CPU ticks of each backend of the database: when first seen (0 if born since the start), last seen
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._read_backends(self.conn.cursor(), start=True)

    def _read_backends(self, cur: Any, start: bool = False) -> None:
        cur.execute(BACKENDS)
        for (pid,) in cur.fetchall():
            st = so._stat(pid)
            if st is None:
                continue
            self.first.setdefault(pid, st[3] if start else 0)
            self.last[pid] = st[3]

    @property
    def database_cpu(self) -> float:
        """CPU seconds of the database's backends over the sampling (a backend that ended lost
        its time since it was last seen, at most ``session_every`` samples)."""
        return sum(self.last[p] - self.first[p] for p in self.last) / float(so.CLK_TCK)

    def _loop(self) -> None:
        with self.conn.cursor() as cur:
            while not self._stop.is_set():
                cur.execute(lk.SAMPLE)
                for classid, objid, objsubid, granted, n in cur.fetchall():
                    k = lk.kind(classid, objid, objsubid)
                    if granted:
                        self.held[k, classid, objid] += 1
                    else:
                        self.waiting[k] += n
                if self.shard_rows:
                    cur.execute(SHARD_ROWS)
                    self.shards.update(int(r[0]) for r in cur.fetchall())
                if self.samples % self.session_every == 0:
                    cur.execute(SESSIONS)
                    for app, n in cur.fetchall():
                        self.sessions[str(app)] = max(self.sessions.get(str(app), 0), int(n))
                    self._read_backends(cur)
                self.samples += 1
                time.sleep(self.interval)

    def halt(self) -> None:
        """Stop sampling (the session stays open): the elapsed time, and its backend's CPU so far."""
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        with self.conn.cursor() as cur:
            self._read_backends(cur)
        st = so._stat(self.backend)
        self.backend_cpu = st[3] / float(so.CLK_TCK) if st else 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    def shard_figures(self, tasks: int) -> dict[str, float]:
        """Shard rows locked: all of them (ms per task, mean rows locked) and the busiest one."""
        n = max(self.samples, 1)
        total = sum(self.shards.values()) / n * self.elapsed
        busiest = max(self.shards.values(), default=0) / n
        return {
            "held_ms_all": total / tasks * 1000,
            "mean_rows_locked": sum(self.shards.values()) / n,
            "busiest_busy": busiest,
            "busiest_held_ms": busiest * self.elapsed / tasks * 1000,
        }


def group_cpu(pgids: list[int]) -> float:
    """CPU seconds so far of every process in these process groups."""
    stats = so._all_stats()
    return sum(own for (_c, _pp, pgrp, own, _ch) in stats.values() if pgrp in pgids) / float(so.CLK_TCK)


def flat(tenant: str, n: int, name: str) -> Any:
    from orchestrator import DAG

    dag = DAG(name, tenant=tenant)
    for i in range(n):
        dag.task(f"t{i:05d}", so.NOOP)
    return dag


@dataclass
class ShardScale:
    args: argparse.Namespace
    base: so.Scaleout
    #: the reconciler instances running, by name (rec-<j> on host worker-hosts + 1 + j)
    recs: dict[str, so.Proc] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    shard_rows: bool = False
    #: the server's postmaster (its processes' CPU is the server's; another cluster's is not)
    postmaster: int | None = None

    @property
    def worker_hosts(self) -> list[so.Host]:
        return self.base.hosts[: self.args.worker_hosts]

    def rec_host(self, name: str) -> so.Host:
        return self.base.hosts[self.args.worker_hosts + int(name.split("-")[1])]

    @property
    def store(self) -> Any:
        return self.base.orc.store

    # -------------------------------------------------------------- reconciler instances

    def start_reconciler(self, name: str) -> None:
        host = self.rec_host(name)
        env = self.base.worker_env(host)  # DB and Redis through this host's proxy, as its application_name
        env.update(
            {
                "ORCHESTRATOR_RECONCILER_SHARDS": str(sh.K),
                "ORCHESTRATOR_RECONCILER_SHARD_LEASE": str(self.args.lease),
                "ORCHESTRATOR_TICK_SECONDS": str(self.args.tick),
                "ORCHESTRATOR_DB_POOL_SIZE": str(self.args.rec_pool_size),
            }
        )
        cmd = ["ip", "netns", "exec", host.ns, sys.executable, "-m", "orchestrator.cli", "reconcile", "--name", name]
        self.recs[name] = so.Proc.spawn(name, cmd, host.tmp / f"{name}.log", env)

    def kill(self, name: str) -> None:
        proc = self.recs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def stop_reconcilers(self) -> None:
        so.stop_all(list(self.recs.values()), 20.0)
        self.recs.clear()

    def check(self) -> None:
        for name, p in self.recs.items():
            if not p.alive():
                raise BenchError(f"reconciler {name} exited ({p.popen.returncode})\n{p.tail()}")
        self.base.check_workers(self.worker_hosts)

    # -------------------------------------------------------------- measures

    def measured(self, n: int, work: Callable[[], Any]) -> dict[str, Any]:
        """Run ``work`` with everything sampled: the CPU of the database's backends and of the
        whole server (the sampler's backend taken off), the workers', the instances', round trips
        at the proxies, locks, sessions."""
        hosts = self.base.hosts[: self.args.worker_hosts + n]
        rec_pgids = [p.pid for p in self.recs.values()]
        before_proxy = self.base.proxy_stats(hosts, "reset")
        cpu0 = so.Cpu.sample(hosts, None, self.base.redis, self.postmaster)
        rec0 = group_cpu(rec_pgids)
        url = self.base.url.render_as_string(hide_password=False)
        sampler = Sections(url, self.args.hz, self.shard_rows)
        try:
            sampler.__enter__()
            try:
                result = work()
            finally:
                sampler.halt()
            cpu = so.Cpu.sample(hosts, None, self.base.redis, self.postmaster).minus(cpu0)
            rec = group_cpu(rec_pgids) - rec0
            after_proxy = self.base.proxy_stats(hosts)
        finally:
            sampler.close()
        self.check()

        def trips(which: list[int]) -> int:
            return sum(after_proxy[i]["routes"]["pg"]["round_trips"] - before_proxy[i]["routes"]["pg"]["round_trips"]
                       for i in which)  # fmt: skip

        w = self.args.worker_hosts
        return {
            "result": result,
            "elapsed": sampler.elapsed,
            "pg_cpu_s": sampler.database_cpu,
            "pg_server_cpu_s": cpu["postgres"] - sampler.backend_cpu,
            "sampler_backend_cpu_s": sampler.backend_cpu,
            "workers_cpu_s": cpu["workers"],
            "reconcilers_cpu_s": rec,
            "proxies_cpu_s": cpu["proxies"],
            "pg_round_trips_workers": trips(list(range(w))),
            "pg_round_trips_reconcilers": trips(list(range(w, w + n))),
            "sampler": sampler,
        }

    def fanout(self, n: int) -> dict[str, Any]:
        tasks = self.args.fanout
        m = self.measured(
            n, lambda: self.base.run(so.fanout(f"fan_{n}", tasks, so.NOOP), self.worker_hosts, self.args.timeout)
        )
        _run, wall = m.pop("result")
        sampler: Sections = m.pop("sampler")
        sections = sampler.figures(tasks)
        out = {
            "tasks": tasks,
            "wall_s": wall,
            "tasks_per_s": tasks / wall,
            "pg_cpu_ms_per_task": m["pg_cpu_s"] * 1000 / tasks,
            "pg_server_cpu_ms_per_task": m["pg_server_cpu_s"] * 1000 / tasks,
            "reconcilers_cpu_ms_per_task": m["reconcilers_cpu_s"] * 1000 / tasks,
            "workers_cpu_ms_per_task": m["workers_cpu_s"] * 1000 / tasks,
            "pg_rt_per_task_workers": m["pg_round_trips_workers"] / tasks,
            "pg_rt_per_task_reconcilers": m["pg_round_trips_reconcilers"] / tasks,
            "sections": sections,
            "shard_rows": sampler.shard_figures(tasks) if self.shard_rows else None,
            "samples": sampler.samples,
            "sessions_peak": sampler.sessions,
            "raw": m,
        }
        log(
            f"{n} instance(s) fan-out: {tasks} tasks in {wall:.2f}s = {tasks / wall:.1f}/s,"
            f" Postgres {out['pg_cpu_ms_per_task']:.2f} ms/task, sections "
            + ", ".join(f"{k} {v['held_ms']:.4f} ms/task" for k, v in sections.items())
        )
        return out

    def idle(self, n: int) -> dict[str, Any]:
        m = self.measured(n, lambda: time.sleep(self.args.idle_seconds))
        sampler: Sections = m.pop("sampler")
        m.pop("result")
        secs = m["elapsed"]
        out = {
            "seconds": secs,
            "pg_cpu_ms_per_s": m["pg_cpu_s"] * 1000 / secs,
            "pg_server_cpu_ms_per_s": m["pg_server_cpu_s"] * 1000 / secs,
            "reconcilers_cpu_ms_per_s": m["reconcilers_cpu_s"] * 1000 / secs,
            "pg_rt_per_s_reconcilers": m["pg_round_trips_reconcilers"] / secs,
            "passes_per_s": n / self.args.tick,
            "sessions_peak": sampler.sessions,
        }
        out["pg_cpu_ms_per_pass"] = out["pg_cpu_ms_per_s"] / out["passes_per_s"]
        log(
            f"{n} instance(s) idle: Postgres {out['pg_cpu_ms_per_s']:.1f} ms/s"
            f" ({out['pg_cpu_ms_per_pass']:.2f} ms per pass), instances {out['pg_rt_per_s_reconcilers']:.0f} RT/s"
        )
        return out

    def actions(self, n: int, idle_ms_per_s: float) -> dict[str, Any]:
        """``--retries`` one-task runs made due at once (bench/shards.py): seconds from due until
        all are READY (DB clock), and the server's CPU per release beyond its idle rate."""
        count = self.args.retries
        ids = sh.submit_runs(self.store, count)

        def work() -> float:
            t0 = sh.make_due(self.store, ids)
            done = sh.wait(lambda: (r := sh.released(self.store, ids))[0] == count and r, 300, "every retry released")
            return float((done[1] - t0).total_seconds())

        m = self.measured(n, work)
        seconds = m["result"]
        extra = m["pg_cpu_s"] * 1000 - idle_ms_per_s * m["elapsed"]
        out = {
            "released": count,
            "seconds": seconds,
            "per_s": count / seconds,
            "pg_cpu_ms_per_action": extra / count,
            "reconcilers_cpu_ms_per_action": m["reconcilers_cpu_s"] * 1000 / count,
        }
        log(
            f"{n} instance(s): {count} due retries released in {seconds:.2f}s = {out['per_s']:.0f}/s,"
            f" Postgres {out['pg_cpu_ms_per_action']:.3f} ms per release beyond idle"
        )
        return out

    def fairness(self, n: int, weights: tuple[int, int]) -> dict[str, Any]:
        """A and B submit at once; B's share of the admissions while both had READY work."""
        import sqlalchemy as sa

        orc = self.base.orc
        for tenant, w in zip(TENANTS, weights, strict=True):
            orc.tenants.set_weight(tenant, w)
        m = self.args.fairness_tasks
        label = f"{weights[0]}to{weights[1]}_{n}"
        runs = [orc.submit(flat(t, m, f"fair_{t[-1]}_{label}")) for t in TENANTS]
        with self.store.engine.connect() as conn:
            since = conn.execute(sa.text("SELECT coalesce(max(id), 0) FROM orc_task_events")).scalar_one()
        for run in runs:
            view = run.wait(self.args.timeout, poll=0.05)
            if view.state.value != "SUCCEEDED":
                raise BenchError(f"fairness run {run.id} ended {view.state.value}")
        ids = [r.id for r in runs]
        q = (
            "WITH adm AS (SELECT e.id, t.tenant FROM orc_task_events e JOIN orc_tasks t"
            " ON t.run_id = e.run_id AND t.key = e.key WHERE e.run_id = ANY(:ids) AND e.id > :since"
            " AND e.to_state = 'QUEUED' AND e.accepted),"
            " until AS (SELECT min(last) AS id FROM (SELECT max(id) AS last FROM adm GROUP BY tenant) x)"
            " SELECT tenant, count(*) FROM adm, until WHERE adm.id <= until.id GROUP BY tenant"
        )
        with self.store.engine.connect() as conn:
            got = dict(conn.execute(sa.text(q), {"ids": ids, "since": since}).all())
        a, b = int(got.get(TENANTS[0], 0)), int(got.get(TENANTS[1], 0))
        want_b = weights[1] / sum(weights)
        share_b = b / max(a + b, 1)
        out = {
            "weights": f"{weights[0]}:{weights[1]}",
            "admitted_a": a,
            "admitted_b": b,
            "a_to_b": a / max(b, 1),
            "b_share": share_b,
            "b_weight_share": want_b,
            "b_behind": (want_b - share_b) / want_b,
        }
        log(
            f"{n} instance(s) fairness {out['weights']}: A:B {a}:{b} = {out['a_to_b']:.2f},"
            f" B behind {out['b_behind']:+.1%}"
        )
        return out

    # -------------------------------------------------------------- one instance count

    def one(self, n: int) -> dict[str, Any]:
        args = self.args
        row: dict[str, Any] = {"instances": n, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        log(f"--- {n} reconciler instance(s), {args.worker_hosts} worker host(s) x {args.slots} threads")
        self.base.reset_state()
        try:
            self.base.start_workers(self.worker_hosts)
            for j in range(n):
                self.start_reconciler(f"rec-{j}")
            sh.split(self.store, n)
            self.check()
            self.base.run(so.fanout(f"warm_{n}", 2 * args.worker_hosts * args.slots, so.NOOP), self.worker_hosts, 120)
            time.sleep(args.settle_seconds)
            row["idle"] = self.idle(n)
            row["fanout"] = self.fanout(n)
            if n in args.fairness_at:
                row["fairness"] = [self.fairness(n, w) for w in args.weights]
            row["actions"] = self.actions(n, row["idle"]["pg_cpu_ms_per_s"])
            for k, v in sh.sessions(self.store, "orcb").items():
                row["fanout"]["sessions_peak"][k] = max(row["fanout"]["sessions_peak"].get(k, 0), v)
            if n >= 2 and args.trials:
                row["failover_detail"] = []
                row["failovers"] = sh.failover_trials(
                    self.store, n, args.trials, args.failover_runs, self.kill, self.start_reconciler,
                    detail=row["failover_detail"],
                )  # fmt: skip
                log(
                    f"{n} instance(s): failovers {[round(f, 2) for f in row['failovers']]} s (lease {args.lease:g});"
                    " the victim's shards claimed after the kill (s): "
                    + ", ".join(
                        f"{fmt(d['claimed_after_kill_min'], '.2f')}..{fmt(d['claimed_after_kill_max'], '.2f')}"
                        for d in row["failover_detail"]
                    )
                )
            self.check()
            row["applied_twice"], row["stale_refused"] = sh.ledger_counts(self.store)
        finally:
            self.stop_reconcilers()
            self.base.stop_workers()
        row["sessions"] = self.sessions(row, n)
        row["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        return row

    def sessions(self, row: dict[str, Any], n: int) -> dict[str, Any]:
        peak = dict(row["fanout"]["sessions_peak"])
        for k, v in row["idle"]["sessions_peak"].items():
            peak[k] = max(peak.get(k, 0), v)
        w = self.args.worker_hosts
        recs = {h.ns: peak.get(h.ns, 0) for h in self.base.hosts[w : w + n]}
        workers = {h.ns: peak.get(h.ns, 0) for h in self.worker_hosts}
        return {
            "per_instance": recs,
            "instances_max": max(recs.values(), default=0),
            "instances_total": sum(recs.values()),
            "workers": workers,
            "total": sum(recs.values()) + sum(workers.values()),
            "all": peak,
        }


# ============================================================================ report


PEAK_TASKS_PER_S = 6000  # seed 002: 100 million tasks a day, 6,000 per second at peak


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def admission_held(row: dict[str, Any]) -> float:
    """The busiest admission lock's held ms per task (per queue, or the cross-group one)."""
    found = [v["held_ms"] for k, v in row["fanout"]["sections"].items() if k.startswith("admission")]
    return max(found, default=0.0)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    header = (
        f"{'inst':>4} {'actions/s':>9} {'tasks/s':>7} {'pgCPU ms/t':>10} {'idle pg ms/s':>12} {'adm held ms/t':>13}"
        f" {'shard rows ms/t':>15} {'failover p50/p99 s':>18} {'twice':>5} {'stale':>5} {'B behind':>16}"
        f" {'sess/inst':>9} {'sess inst':>9} {'sess all':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['instances']:>4}  FAILED: {r['error'].splitlines()[0]}")
            continue
        f = r["fanout"]
        fo = r.get("failovers") or []
        fo_s = f"{statistics.median(fo):.2f}/{max(fo):.2f}" if fo else "-"
        fair = " ".join(f"{x['weights']} {x['b_behind'] * 100:+.0f}%" for x in r.get("fairness", [])) or "-"
        rows_ms = f["shard_rows"]["held_ms_all"] if f["shard_rows"] else None
        lines.append(
            f"{r['instances']:>4} {r['actions']['per_s']:>9.0f} {f['tasks_per_s']:>7.1f}"
            f" {f['pg_cpu_ms_per_task']:>10.2f}"
            f" {r['idle']['pg_cpu_ms_per_s']:>12.1f} {admission_held(r):>13.4f} {fmt(rows_ms, '.4f'):>15}"
            f" {fo_s:>18} {r['applied_twice']:>5} {r['stale_refused']:>5} {fair:>16}"
            f" {r['sessions']['instances_max']:>9} {r['sessions']['instances_total']:>9} {r['sessions']['total']:>8}"
        )
    return lines


def details(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    for r in rows:
        if "error" in r:
            continue
        f, i = r["fanout"], r["idle"]
        ms = f["pg_cpu_ms_per_task"]
        sections = "; ".join(
            f"{k}: held {v['held_ms']:.4f} ms/t ({v['busy']:.1%} busy, {v['locks']:.0f} locks),"
            f" waited {v['wait_ms']:.4f} ms/t, ceiling {fmt(1000 / v['held_ms'] if v['held_ms'] else None, '.0f')}/s"
            for k, v in f["sections"].items()
        )
        lines.append(
            f"  {r['instances']} instance(s): fan-out {f['tasks']} in {f['wall_s']:.2f}s; CPU ms/task: postgres"
            f" {ms:.2f} (the whole server {f['pg_server_cpu_ms_per_task']:.2f}), workers"
            f" {f['workers_cpu_ms_per_task']:.2f}, instances {f['reconcilers_cpu_ms_per_task']:.2f};"
            f" pg round trips/task: workers {f['pg_rt_per_task_workers']:.2f}, instances"
            f" {f['pg_rt_per_task_reconcilers']:.3f}; idle: postgres {i['pg_cpu_ms_per_s']:.1f} ms/s ="
            f" {i['pg_cpu_ms_per_pass']:.2f} ms per pass (whole server {i['pg_server_cpu_ms_per_s']:.1f} ms/s),"
            f" instances {i['pg_rt_per_s_reconcilers']:.0f} round trips/s;"
            f" {1000 / ms:.0f} tasks/s per Postgres core, {PEAK_TASKS_PER_S * ms / 1000:.1f} cores for"
            f" {PEAK_TASKS_PER_S}/s; sections ({f['samples']} samples): {sections or 'none seen'}"
        )
        a = r["actions"]
        lines.append(
            f"    actions: {a['released']} due retries released in {a['seconds']:.3f}s (up to a tick's wait included);"
            f" Postgres {a['pg_cpu_ms_per_action']:.3f} ms and the instances"
            f" {a['reconcilers_cpu_ms_per_action']:.3f} ms of CPU per release"
            " (the server's beyond its idle rate; make_due's UPDATE included)"
        )
        if f["shard_rows"]:
            s = f["shard_rows"]
            lines.append(
                f"    shard rows locked: {s['held_ms_all']:.4f} ms/task over all {sh.K} ({s['mean_rows_locked']:.2f}"
                f" locked on average), busiest shard {s['busiest_busy']:.1%} of the time ="
                f" {s['busiest_held_ms']:.4f} ms/t"
            )
        lines.append(f"    failovers (s): {r.get('failovers') or '-'}; sessions: {r['sessions']['all']}")
        for d in r.get("failover_detail") or []:
            lines.append(
                f"      failover {d['failover']:.2f}s: the victim's {d['shards']} shards claimed"
                f" {fmt(d['claimed_after_kill_min'], '.2f')}..{fmt(d['claimed_after_kill_max'], '.2f')}s after the"
                f" kill ({d['claimed_before_kill']} before it)"
            )
        for x in r.get("fairness", []):
            lines.append(
                f"    fairness {x['weights']}: admitted A:B {x['admitted_a']}:{x['admitted_b']} = {x['a_to_b']:.2f},"
                f" B's share {x['b_share']:.1%} against {x['b_weight_share']:.1%} (behind {x['b_behind']:+.1%})"
            )
    return lines


def report(bench: ShardScale, meta: dict[str, Any]) -> str:
    args = bench.args
    lines = [
        f"Sharded reconciler in namespaces: K={sh.K}, lease {args.lease:g}s, tick {args.tick:g}s; {args.worker_hosts}"
        f" worker host(s) x {args.slots} threads; {args.rtt_ms:g} ms RTT per host; fan-out {args.fanout} no-ops;"
        f" {args.retries} retries; {args.trials} failover trials; fairness {args.fairness_tasks} tasks per tenant"
        f" ({meta['cpus']} CPUs, Python {meta['python']}, load average {meta['loadavg_start']} at the start)",
        "",
        *table(bench.rows, args),
        "",
        "actions/s: due retries released (RETRYING -> READY) per second, DB clock; tasks/s: fan-out middle tasks over"
        " submit -> final; pgCPU: the bench database's backends per middle task (/proc: the server is shared);"
        " idle pg: the server's CPU per second with nothing to do; adm held: the busiest admission lock's time held"
        " per task (pg_locks samples); shard rows: time any shard row was locked, summed over the shards, per task;"
        " failover: kill -9 of shard 0's owner -> its shards' due retries released (lease"
        f" {args.lease:g}s); twice: releases applied twice (ledger);"
        " stale: rejected ledger rows for a stale shard epoch;"
        " B behind: (B's weight share - B's admitted share) / B's weight share while both had READY work;"
        " sess: peak server sessions per instance, of all instances, of instances + workers.",
        "",
        "details:",
        *details(bench.rows, args),
    ]
    return "\n".join(lines)


# ============================================================================ main


def parse_counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if any(v < 1 or v > 32 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: between 1 and 32 each")
    return values


def parse_weights(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+):(\d+)\s*", part)
        if not m or not int(m[1]) or not int(m[2]):
            raise argparse.ArgumentTypeError(f"--weights {text!r}: A:B pairs of positive integers, comma-separated")
        out.append((int(m[1]), int(m[2])))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--instances", type=parse_counts, default=[1, 2, 4, 8], help="instance counts (default 1,2,4,8)")
    p.add_argument("--rtt-ms", type=float, default=1.0, help="RTT each host's proxy adds (default 1.0)")
    p.add_argument("--worker-hosts", type=int, default=2, help="hosts with a celery worker (default 2)")
    p.add_argument("--slots", type=int, default=8, help="threads per worker (default 8)")
    p.add_argument("--pool-size", type=int, default=4, help="ORCHESTRATOR_DB_POOL_SIZE of the workers (default 4)")
    p.add_argument("--rec-pool-size", type=int, default=2, help="ORCHESTRATOR_DB_POOL_SIZE of an instance (default 2)")
    p.add_argument("--fanout", type=int, default=2000, help="no-op tasks of the fan-out (default 2000)")
    p.add_argument("--retries", type=int, default=1000, help="due retries released at once (default 1000)")
    p.add_argument("--trials", type=int, default=3, help="failover trials per instance count >= 2 (default 3)")
    p.add_argument("--failover-runs", type=int, default=200, help="runs made due per failover trial (default 200)")
    p.add_argument("--lease", type=float, default=2.0, help="ORCHESTRATOR_RECONCILER_SHARD_LEASE (default 2)")
    p.add_argument("--tick", type=float, default=0.5, help="ORCHESTRATOR_TICK_SECONDS of the instances (default 0.5)")
    p.add_argument("--fairness-at", type=parse_counts, default=[1, 4], help="instance counts with fairness (1,4)")
    p.add_argument("--weights", type=parse_weights, default=[(1, 1), (3, 1)], help="A:B weights (default 1:1,3:1)")
    p.add_argument("--fairness-tasks", type=int, default=400, help="no-ops per tenant in fairness (default 400)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="the idle measure's length (default 5)")
    p.add_argument("--settle-seconds", type=float, default=2.0, help="idle after the warm-up (default 2)")
    p.add_argument("--hz", type=float, default=200.0, help="lock samples per second (default 200)")
    p.add_argument("--database-url", default=DEFAULT_DB, help=f"name must contain 'shardscale' (default {DEFAULT_DB})")
    p.add_argument("--redis-url", default=DEFAULT_REDIS, help=f"flushed before each count (default {DEFAULT_REDIS})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take (default 300)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds the workers may take to start")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    if min(args.worker_hosts, args.slots, args.pool_size, args.rec_pool_size, args.fanout, args.retries) < 1:
        p.error("--worker-hosts, --slots, --pool-size, --rec-pool-size, --fanout and --retries must be positive")
    if args.tick <= 0 or args.lease <= args.tick:
        p.error("--tick must be positive and below --lease")
    if args.worker_hosts + max(args.instances) > 64:
        p.error("at most 64 hosts in all")
    if not args.redis_url.startswith("redis://"):
        p.error("--redis-url must be redis://host:port/db")
    # what bench/scaleout.py's code reads from its arguments
    args.group_commit, args.claim_delay, args.poll = True, 0.0, 0.02
    return args


def prepare(bench: ShardScale) -> None:
    """The database (created, migrated), ``pgrowlocks`` in it when the server has it."""
    import sqlalchemy as sa

    bench.base.prepare_database()
    with bench.store.engine.connect() as conn:
        backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    found = so._stat(backend)
    if found is None:
        raise BenchError("the server's processes are not visible in /proc: run this on the server's machine")
    bench.postmaster = found[1]
    log(f"the server's postmaster is pid {bench.postmaster}")
    try:
        with bench.store.engine.begin() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pgrowlocks")
        bench.shard_rows = True
    except sa.exc.DBAPIError as exc:
        log(f"pgrowlocks is not available: the shard rows' locks are not sampled ({exc})")


def sitting(bench: ShardScale) -> bool:
    """Every instance count of the arguments; a failed count is a row with its error."""
    import sqlalchemy as sa

    from orchestrator.core.errors import OrchestratorError

    args = bench.args
    so.cleanup_network()
    prepare(bench)
    bench.base.setup_hosts(args.worker_hosts + max(args.instances))
    for n in args.instances:
        try:
            bench.rows.append(bench.one(n))
        except (BenchError, OrchestratorError, sa.exc.SQLAlchemyError, OSError, SystemExit) as exc:
            log(f"FAILED: {n} instance(s): {type(exc).__name__}: {exc}")
            for p in [*bench.recs.values(), *(h.worker for h in bench.worker_hosts if h.worker)]:
                log(p.tail(10))
            bench.rows.append({"instances": n, "error": str(exc)})
            bench.stop_reconcilers()
            bench.base.stop_workers()
    return all("error" not in r for r in bench.rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("this bench makes network namespaces: run it as root")
    import urllib.parse

    import sqlalchemy as sa

    url = sa.engine.make_url(args.database_url)
    if not url.drivername.startswith("postgresql") or "shardscale" not in str(url.database):
        raise SystemExit("--database-url: a PostgreSQL database whose name contains 'shardscale' (it is emptied)")
    parsed = urllib.parse.urlsplit(args.redis_url)
    redis_url = (parsed.hostname or "127.0.0.1", parsed.port or 6379, int(parsed.path.strip("/") or 0))
    tmp = Path(tempfile.mkdtemp(prefix="orc-shardscale-"))
    so.configure_process(url, args.redis_url, tmp, args.pool_size)
    base = so.Scaleout(args, url, redis_url, tmp, extra_env={"ORCHESTRATOR_WORKER_RECONCILER": "0"})
    bench = ShardScale(args, base)
    meta: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(args).items()},
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    started = time.perf_counter()
    ok = False
    with sigterm_as_exit():
        try:
            ok = sitting(bench)
        except KeyboardInterrupt:
            log("interrupted")
        except BenchError as exc:
            log(f"FAILED: {exc}")
        finally:
            bench.stop_reconcilers()
            so.stop_all([h.worker for h in base.hosts if h.worker is not None], 20.0)
            so.stop_all([h.proxy for h in base.hosts if h.proxy is not None], 5.0)
            for h in base.hosts:
                so.sh("ip", "netns", "del", h.ns, check=False)
                so.sh("ip", "link", "del", h.veth, check=False)
            with contextlib.suppress(Exception):
                base.redis.flushdb()
            base.close()
    meta["total_s"] = round(time.perf_counter() - started, 1)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if bench.rows:
        print(report(bench, meta))
        print(f"\n(total bench time {meta['total_s']}s, load average at the end {meta['loadavg_end']})")
    if args.json:
        rows = [{k: v for k, v in r.items()} for r in bench.rows]
        for r in rows:
            if "fanout" in r:
                r["fanout"] = {k: v for k, v in r["fanout"].items() if k != "raw"}
        print(json.dumps({"meta": meta, "rtt": base.rtt, "rows": rows, "complete": ok}, default=str))
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"kept {tmp} (worker, instance and proxy logs) for inspection")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
