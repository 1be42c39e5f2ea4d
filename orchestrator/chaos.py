"""``orchestrator chaos``: a soak that runs many DAGs on a real local deployment while faults
are injected at random, then proves from the database that nothing was lost or committed twice.

It starts, on this machine only: a private redis-server on a free 127.0.0.1 port, N prefork
Celery workers and a reconciler loop, all against the Postgres database given. Faults: a pool
child killed (-9), a whole worker killed (-9) and restarted, a worker paused past its lease
(SIGSTOP/SIGCONT), Redis restarted (SHUTDOWN NOSAVE) or flushed (FLUSHALL), the application's
Postgres backends terminated, and a duplicate publish of a queued task's message.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from . import migrate
from .dag import DAG
from .engine import Orchestrator
from .protocol import FencingToken, send_options, sign
from .store import Store, make_engine

ROOT = Path(__file__).resolve().parents[1]
P = "tasks.probes."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Stop a process group this module started: SIGTERM, then SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@dataclass
class Deployment:
    database_url: str
    workers: int
    data: Path
    redis_port: int = field(default_factory=free_port)
    redis: subprocess.Popen[bytes] | None = None
    worker_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    reconciler: subprocess.Popen[bytes] | None = None

    @property
    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        env.update(
            ORCHESTRATOR_DATABASE_URL=self.database_url,
            ORCHESTRATOR_BROKER_URL=self.broker_url,
            ORCHESTRATOR_DATA_DIR=str(self.data),
            ORCHESTRATOR_LEASE_SECONDS="2",
            ORCHESTRATOR_TICK_SECONDS="0.3",
            ORCHESTRATOR_DISPATCH_TIMEOUT="4",
            ORCHESTRATOR_WORKER_TTL="6",
            ORCHESTRATOR_CRASH_LOOP_THRESHOLD="50",
            ORCHESTRATOR_POISON_THRESHOLD="0",
            ORCHESTRATOR_RECORD_PROBE_EFFECTS="1",
            ORCHESTRATOR_HAZARD_PROBES="1",
            ORCHESTRATOR_MAX_TIME_LIMIT="60",
            PYTHONPATH=str(ROOT),
        )
        return env

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (self.data / f"{name}.log").open("ab")
        return subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    def start_redis(self) -> None:
        self.redis = self._spawn(
            "redis",
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        )
        self._wait(lambda: self._redis_cmd("PING") == "PONG", "redis")

    def _redis_cmd(self, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(self.redis_port), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip()

    def start_worker(self, name: str) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "config.celery_app", "worker", "--pool", "prefork", "-c", "2",
               "--without-gossip", "--without-mingle", "--loglevel", "INFO", "-n", f"{name}@%h"]  # fmt: skip
        self.worker_procs[name] = self._spawn(name, cmd)

    def start(self) -> None:
        self.start_redis()
        for i in range(self.workers):
            self.start_worker(f"chaos{i}")
        cmd = [sys.executable, "-m", "orchestrator.cli", "reconcile", "--interval", "0.3"]
        self.reconciler = self._spawn("reconciler", cmd)

    def stop(self) -> None:
        for proc in [*self.worker_procs.values(), self.reconciler, self.redis]:
            if proc is not None:
                stop_group(proc)

    @staticmethod
    def _wait(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not come up in {timeout}s")


def random_dag(rng: random.Random, i: int) -> DAG:
    dag = DAG(f"chaos-{i}", tenant=rng.choice(["acme", "globex", "initech"]))
    keys: list[str] = []
    for n in range(rng.randint(3, 12)):
        ups = rng.sample(keys, k=min(len(keys), rng.randint(0, 2))) if keys else []
        kind = rng.random()
        if kind < 0.35:
            dag.task(f"n{n}", P + "sleep", kwargs={"seconds": round(rng.uniform(0.05, 0.6), 2)}, upstream=ups,
                     max_attempts=10, backoff={"base": 0.2, "cap": 1.0})  # fmt: skip
        elif kind < 0.5:
            dag.task(f"n{n}", P + "flaky", kwargs={"fail_times": rng.randint(1, 2)}, upstream=ups, max_attempts=10,
                     backoff={"base": 0.2, "cap": 1.0})  # fmt: skip
        else:
            dag.task(f"n{n}", P + ("echo" if kind < 0.75 else "noop"), upstream=ups, max_attempts=10,
                     backoff={"base": 0.2, "cap": 1.0})  # fmt: skip
        keys.append(f"n{n}")
    return dag


class Injector:
    """Picks and applies one random fault at a time."""

    def __init__(self, dep: Deployment, orc: Orchestrator, rng: random.Random) -> None:
        self.dep, self.orc, self.rng = dep, orc, rng
        self.counts: Counter[str] = Counter()
        self.last_fault = time.monotonic()

    def children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        try:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        except OSError:
            return []
        return [int(x) for x in out.stdout.split()]

    def inject(self) -> None:
        kinds = ["kill_child", "kill_child", "kill_worker", "pause_worker", "redis_restart", "redis_flush",
                 "pg_terminate", "duplicate_publish"]  # fmt: skip
        kind = self.rng.choice(kinds)
        getattr(self, kind)()
        self.counts[kind] += 1
        self.last_fault = time.monotonic()

    def _worker(self) -> tuple[str, subprocess.Popen[bytes]]:
        name = self.rng.choice(sorted(self.dep.worker_procs))
        return name, self.dep.worker_procs[name]

    def kill_child(self) -> None:
        _, proc = self._worker()
        kids = self.children(proc)
        if kids:
            os.kill(self.rng.choice(kids), signal.SIGKILL)

    def kill_worker(self) -> None:
        name, proc = self._worker()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.dep.start_worker(name)

    def pause_worker(self) -> None:
        _, proc = self._worker()
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(2.5 + self.rng.random())  # past the 2 s lease
        os.killpg(proc.pid, signal.SIGCONT)

    def redis_restart(self) -> None:
        self.dep._redis_cmd("SHUTDOWN", "NOSAVE")
        if self.dep.redis is not None:
            self.dep.redis.wait(10)
        time.sleep(0.5)
        self.dep.start_redis()

    def redis_flush(self) -> None:
        self.dep._redis_cmd("FLUSHALL")

    def pg_terminate(self) -> None:
        db = make_engine(self.dep.database_url)
        try:
            with db.connect() as conn:
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
        finally:
            db.dispose()

    def duplicate_publish(self) -> None:
        found = self.orc.reads.in_flight(1)
        if not found:
            return
        row = found[0]
        token = FencingToken(row.run_id, row.key, row.attempt)
        signature = sign(self.orc.signing_key, row.task_name, token)
        options = send_options(token, queue=row.queue, soft_time_limit=None, time_limit=None, signature=signature)
        self.orc.app.send_task(row.task_name, **options)


def run_chaos(
    *,
    runs: int,
    seed: int,
    database_url: str,
    workers: int = 2,
    min_faults: int = 0,
    fault_interval: float = 0.6,
    timeout: float = 900.0,
    echo: Callable[[str], None] = print,
) -> int:
    """Run the soak; print the report; return 0 only if no invariant was broken (nothing lost,
    stuck or committed twice, no illegal transition, no child started before its parent).

    At least ``runs`` runs are driven; more are submitted while fewer than ``min_faults`` faults
    have been injected, so every fault lands on a busy deployment.
    """
    # two generators, so the DAGs do not depend on how the faults interleave with them
    rng = random.Random(seed)
    fault_rng = random.Random(seed + 1_000_003)
    data = Path(tempfile.mkdtemp(prefix="orc-chaos-"))
    dep = Deployment(database_url, workers, data)
    engine = make_engine(database_url)
    migrate.reset(engine)
    engine.dispose()
    for k, v in dep.env().items():
        os.environ[k] = v
    from .celery_app import get_app

    orc = Orchestrator(app=get_app(), store=Store(database_url))
    started = time.monotonic()
    dep.start()
    injector = Injector(dep, orc, fault_rng)
    run_ids: list[str] = []
    report: dict[str, Any] = {}
    try:
        Deployment._wait(lambda: _live_workers(orc) >= workers, "workers", 60)
        next_fault = time.monotonic() + 2.0
        pending = list(range(runs))
        while time.monotonic() - started < timeout:
            if pending and len(run_ids) - _finished(orc, run_ids) < 8:
                i = pending.pop(0)
                try:
                    run_ids.append(orc.submit(random_dag(rng, i), idempotency_key=f"chaos-{seed}-{i}").id)
                except Exception as exc:  # noqa: BLE001 - a fault hit the submit; retry the same key later
                    echo(f"submit {i} failed during a fault ({type(exc).__name__}); retrying")
                    pending.insert(0, i)
                    time.sleep(0.5)
            enough_faults = sum(injector.counts.values()) >= min_faults
            if not pending and not enough_faults:
                # faults only mean something while there is work: keep the deployment busy
                pending.append(runs + len(run_ids))
            if time.monotonic() >= next_fault and not enough_faults:
                try:
                    injector.inject()
                except Exception as exc:  # noqa: BLE001 - a failed injection is reported, the soak goes on
                    echo(f"fault injection failed: {exc!r}")
                next_fault = time.monotonic() + fault_interval * (0.5 + rng.random())
            if not pending and enough_faults and _finished(orc, run_ids) == len(run_ids):
                break
            time.sleep(0.05)
        # from the last fault until every run was final: how long the system took to heal
        recovered = time.monotonic() - injector.last_fault
        problems = _safe_check(orc, run_ids)
        report = _summary(orc, run_ids, problems, injector.counts, recovered, time.monotonic() - started)
    finally:
        dep.stop()
        shutil.rmtree(data, ignore_errors=True)
    for line in _format(report):
        echo(line)
    clean = not (report["lost"] or report["committed_twice"] or report["stuck"] or report["other_violations"])
    return 0 if clean else 1


def _live_workers(orc: Orchestrator) -> int:
    return orc.live_workers()


def _finished(orc: Orchestrator, run_ids: list[str]) -> int:
    for _ in range(5):
        try:
            return orc.reads.finished_runs(run_ids)
        except sa.exc.DBAPIError:
            time.sleep(0.2)
    return 0


def _safe_check(orc: Orchestrator, run_ids: list[str]) -> list[str]:
    for _ in range(5):
        try:
            return orc.verify(run_ids)
        except sa.exc.DBAPIError:
            time.sleep(0.5)
    return ["invariant check could not read the database"]


def _summary(
    orc: Orchestrator, run_ids: list[str], problems: list[str], faults: Counter[str], recovered: float, took: float
) -> dict[str, Any]:
    reads = orc.reads
    states = reads.task_states(run_ids)
    executions = sum(int(e[3]) for e in reads.snapshot(run_ids).effects)
    rejected = reads.rejected_events(run_ids)
    stuck = sum(n for st, n in states.items() if st in ("PENDING", "READY", "QUEUED", "RUNNING", "RETRYING"))
    return {
        "runs": len(run_ids),
        "tasks": sum(states.values()),
        "task_states": states,
        "executions": executions,
        "rejected_events": rejected,
        "faults": dict(faults),
        "faults_total": sum(faults.values()),
        "lost": sum(1 for p in problems if "stuck in" in p),
        "committed_twice": sum(1 for p in problems if "committed twice" in p or "accepted results" in p),
        "stuck": stuck,
        "other_violations": [p for p in problems if "stuck in" not in p and "committed twice" not in p][:20],
        "recovery_seconds": round(recovered, 1),
        "seconds": round(took, 1),
    }


def _format(r: dict[str, Any]) -> list[str]:
    if not r:
        return ["chaos: no report (the soak did not start)"]
    faults = ", ".join(f"{k}={v}" for k, v in sorted(r["faults"].items()))
    lines = [
        f"runs: {r['runs']}  tasks: {r['tasks']}  executions: {r['executions']}",
        f"rejected events (fenced duplicates and late results): {r['rejected_events']}",
        f"task states: {r['task_states']}",
        f"faults injected: {r['faults_total']} ({faults})",
        f"lost: {r['lost']}  committed twice: {r['committed_twice']}  stuck: {r['stuck']}",
        f"time to recover (last fault -> every run final): {r['recovery_seconds']}s  (soak took {r['seconds']}s)",
    ]
    lines.extend(f"violation: {v}" for v in r["other_violations"])
    return lines
