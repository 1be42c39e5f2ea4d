"""The fault suite's harness: a private Redis, real worker / reconciler subprocesses, and checks.

Everything runs on 127.0.0.1 against the suite's own Postgres database (``orchestrator_fault``)
and its own ``redis-server`` (a child process on a free port), so a test may SHUTDOWN, FLUSHALL,
restart or pause anything without touching the shared services other suites use.

Why :func:`probe_registry`: the process-wide Celery app (``get_app``) was built from the
environment of ``tests/conftest.py`` (the integration database and the shared Redis) and the
task modules register their tasks on that app. The fault suite publishes through its own app
(``create_app`` on the fault settings) and only borrows the global app's *registry* to check
that the task names a DAG uses exist. Nothing is ever published through the global app.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState, Settings, TaskState
from orchestrator.core.registry import CeleryRegistry
from orchestrator.services.invariants import check_runs
from orchestrator.store import Store
from orchestrator.store import schema as s

ROOT = Path(__file__).resolve().parents[2]
P = "tasks.probes."
#: the queues the orchestrator routes to by default (kombu keeps one Redis list per queue)
QUEUES = ("orchestrator.high", "orchestrator.default", "orchestrator.low")
#: where kombu's virtual transport puts a message whose exchange has no binding
UNDELIVERABLE = "ae.undeliver"
#: kombu's Redis bookkeeping of delivered, not yet acknowledged messages
UNACKED_KEYS = ("unacked", "unacked_index")
#: every wait on the database (or a log) gets this many times the bound a test names: a bound is
#: how long to wait for an event before failing, never the claim under test (a claim of speed is
#: read from the ledger's times), and a loaded machine (the full suite on two cores) needs more
WAIT_SCALE = float(os.environ.get("ORCHESTRATOR_TEST_WAIT_SCALE", "3"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, *, poll: float = 0.1, context: Callable[[], str] = str
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``
    (times :data:`WAIT_SCALE`; with ``context()`` appended: process logs, events)."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{context()}")
        time.sleep(poll)


# ---------------------------------------------------------------------------- private Redis


class RedisServer:
    """A ``redis-server`` child process on a free port that tests may shut down and restart."""

    def __init__(self, log: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is required on PATH for the fault suite (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 20.0) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--daemonize", "no"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
            with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if self.client.ping():
                    return
            time.sleep(0.05)
        pytest.fail(f"redis-server on port {self.port} not ready after {timeout}s")

    def shutdown_nosave(self) -> None:
        """``SHUTDOWN NOSAVE``: the server exits and every message it held is gone."""
        with contextlib.suppress(redis.exceptions.ConnectionError):
            self.client.shutdown(nosave=True)
        assert self.proc is not None
        self.proc.wait(10)
        self.client.connection_pool.disconnect()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class PgBouncer:
    """A real PgBouncer (Debian's package) in transaction mode on a free port, in front of the
    test server, with at most ``pool_size`` server connections per database and user. It will
    not run as root: it is started as ``postgres`` then, in a directory that user owns."""

    def __init__(self, database_url: str, *, pool_size: int) -> None:
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(self.binary):
            pytest.fail("pgbouncer is required (Debian package pgbouncer; .ci/run installs it)")
        self.target = sa.engine.make_url(database_url)
        self.pool_size = pool_size
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="orc-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The target database's URL, through PgBouncer."""
        return self.target.set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def start(self, timeout: float = 20.0) -> None:
        user = self.target.username or "postgres"
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.target.host or '127.0.0.1'} port={self.target.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {self.pool_size}\nmin_pool_size = 0\n"
            "reserve_pool_size = 0\nmax_client_conn = 1000\nserver_reset_query =\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\npidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        cmd = [self.binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            for f in self.dir.iterdir():
                shutil.chown(f, "postgres", "postgres")
            cmd[1:1] = ["-u", "postgres"]
        with (self.dir / "stdout.log").open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"pgbouncer exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"pgbouncer did not listen on {self.port} in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        files = (self.dir / "pgbouncer.log", self.dir / "stdout.log")
        return "\n".join(f.read_text(errors="replace")[-3000:] for f in files if f.exists())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------- subprocesses


@dataclass
class Proc:
    """A subprocess we started in its own session (its pid is its process group id)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    paused: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 3000) -> str:
        return f"--- {self.name} ({self.log}) ---\n{self.text()[-n:]}"

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        if sig == signal.SIGSTOP:
            self.paused = True
        elif sig == signal.SIGCONT:
            self.paused = False

    def stop(self, timeout: float = 10.0) -> None:
        """Warm-stop the whole process group; SIGKILL it if it does not stop in time."""
        if self.paused:
            self.signal_group(signal.SIGCONT)
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # pool children (or a faketime'd child) may outlive the leader: sweep the group
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def probe_registry() -> CeleryRegistry:
    """The registry where ``tasks.probes`` / ``tasks.etl`` registered their tasks (the global app)."""
    from orchestrator.runtime.celery_app import get_app

    return CeleryRegistry(get_app())


@dataclass
class Cluster:
    """One scenario's processes and clients. ``env`` is what every subprocess gets."""

    tmp: Path
    redis_server: RedisServer
    database_url: str
    settings_env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    _orc: Orchestrator | None = None

    # -- configuration

    def env(self, **overrides: str) -> dict[str, str]:
        """The subprocess environment: ours without any ORCHESTRATOR_* from the test process."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        env.update(self.settings_env)
        env.update(overrides)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def configure(self, **overrides: str) -> None:
        """Change the settings of this scenario (before any process is started)."""
        assert not self.procs and self._orc is None, "configure() before starting anything"
        self.settings_env.update(overrides)

    @property
    def settings(self) -> Settings:
        return Settings.from_env(self.settings_env)

    @property
    def orc(self) -> Orchestrator:
        if self._orc is None:
            from orchestrator.runtime.celery_app import create_app

            settings = self.settings
            store = Store(
                settings.database_url,
                poison_threshold=settings.poison_threshold,
                crash_loop_threshold=settings.crash_loop_threshold,
                worker_ttl=settings.worker_ttl,
                dispatch_depth=settings.dispatch_depth,
                pool_size=settings.db_pool_size,
                transaction_pooler=settings.db_transaction_pooler,
                direct_url=settings.db_direct_url,
            )
            # publishes on the fault suite's app (private Redis); checks names against the global app's tasks
            self._orc = Orchestrator(
                settings, app=create_app(settings, main="fault"), store=store, registry=probe_registry()
            )
        return self._orc

    @property
    def store(self) -> Store:
        return self.orc.store

    @property
    def redis(self) -> redis.Redis:
        return self.redis_server.client

    # -- processes

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.tmp / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        name: str,
        *,
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        prefix: Iterable[str] = (),
        pool: str = "prefork",
    ) -> Proc:
        """A real worker ``<name>@fault``, prefork unless ``pool`` says otherwise (not waited
        for: see :meth:`wait_ready`)."""
        cmd = [*prefix, sys.executable, "-m", "celery", "-A", "config.celery_app", "worker", "--pool", pool]
        cmd += ["-c", str(concurrency), "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
        cmd += ["-n", f"{name}@fault"]
        return self._spawn(name, cmd, self.env(**(env or {})))

    def wait_ready(self, *workers: Proc, timeout: float = 60.0) -> None:
        """Until each worker's capacity row is in ``orc_workers`` (its worker_ready signal ran)."""
        timeout *= WAIT_SCALE
        want = {f"{w.name}@fault": w for w in workers}
        deadline = time.monotonic() + timeout
        while True:
            for w in workers:
                if w.popen.poll() is not None:
                    pytest.fail(f"worker {w.name} exited with {w.popen.returncode}\n{w.tail()}")
            with self.store.engine.connect() as conn:
                names = set(conn.execute(sa.select(s.workers.c.name)).scalars())
            if set(want) <= names:
                return
            if time.monotonic() >= deadline:
                pytest.fail(f"workers {sorted(set(want) - names)} not ready after {timeout}s\n" + self.tails())
            time.sleep(0.1)

    def worker(self, name: str, **kwargs: Any) -> Proc:
        w = self.start_worker(name, **kwargs)
        self.wait_ready(w)
        return w

    def reconciler(self, name: str = "reconciler", *, interval: float = 0.3, **env: str) -> Proc:
        """``orchestrator reconcile`` in a loop: the safety net (several may run at once)."""
        cmd = [sys.executable, "-m", "orchestrator.cli", "reconcile", "--interval", str(interval)]
        return self._spawn(name, cmd, self.env(**env))

    def cli(self, *args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            cwd=ROOT,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:  # TERM everything first, then wait: stopping in parallel is faster
            if p.paused:
                p.signal_group(signal.SIGCONT)
            if p.popen.poll() is None:
                p.signal_group(signal.SIGTERM)
        for p in self.procs:
            p.stop()
        if self._orc is not None:
            with contextlib.suppress(Exception):
                self._orc.app.close()
            self._orc.store.dispose()

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str, *, run_id: str | None = None) -> Any:
        """:func:`wait_for` that fails with the process logs and the run's events."""

        def context() -> str:
            lines = [self.tails()]
            if run_id is not None:
                lines.extend(
                    f"{e.key}#{e.attempt} {e.from_state} -> {e.to_state} by {e.actor} "
                    f"{'ok' if e.accepted else 'REJECTED'} {e.reason or ''}"
                    for e in self.events(run_id)
                )
            return "\n".join(lines)

        return wait_for(predicate, timeout, what, context=context)

    # -- database reads

    def wait_run(self, run_id: str, timeout: float = 60.0) -> RunState:
        """Until the run is final; on timeout (times :data:`WAIT_SCALE`) fail with its tasks and
        the process logs."""
        timeout *= WAIT_SCALE
        deadline = time.monotonic() + timeout
        while True:
            state = self.store.reads.run_state(run_id)
            if state.terminal:
                return state
            if time.monotonic() >= deadline:
                rows = [(t.key, t.state.value, t.attempt, t.worker) for t in self.store.reads.get_tasks(run_id)]
                pytest.fail(f"run {run_id} still {state.value} after {timeout}s: {rows}\n{self.tails()}")
            time.sleep(0.1)

    def wait_task(self, run_id: str, key: str, pred: Callable[[Any], bool], timeout: float, what: str) -> Any:
        def check() -> Any:
            t = self.store.reads.get_task(run_id, key)
            return t if pred(t) else None

        timeout *= WAIT_SCALE
        deadline = time.monotonic() + timeout
        while True:
            t = check()
            if t is not None:
                return t
            if time.monotonic() >= deadline:
                now = self.store.reads.get_task(run_id, key)
                pytest.fail(
                    f"{what}: {key} is {now.state.value} attempt {now.attempt} after {timeout}s\n{self.tails()}"
                )
            time.sleep(0.05)

    def events(self, run_id: str) -> list[Any]:
        """The run's task events, oldest first (the run's own events, ``key`` null, left out)."""
        return [e for e in self.store.reads.events(run_id) if e.key is not None]

    def run_events(self, run_id: str) -> list[Any]:
        """The run's own transitions (ledger rows with a null key)."""
        return [e for e in self.store.reads.events(run_id) if e.key is None]

    def effects(self, run_id: str) -> Counter[tuple[str, int]]:
        """Executions of probe bodies per (key, attempt)."""
        effects = self.store.reads.snapshot([run_id]).effects
        return Counter({(e.key, e.attempt): int(e[3]) for e in effects})

    # -- broker

    def broker_backlog(self) -> dict[str, int]:
        """Messages still in the private Redis: per queue list (any priority sub-list), the
        undeliverable queue, and kombu's unacked bookkeeping."""
        r = self.redis
        counts: dict[str, int] = {}
        for raw in r.scan_iter(match="orchestrator.*"):
            k = raw.decode()
            if r.type(k) == b"list":
                counts[k] = int(r.llen(k))
        for q in QUEUES:
            counts.setdefault(q, 0)
        counts[UNDELIVERABLE] = int(r.llen(UNDELIVERABLE))
        counts["unacked"] = int(r.hlen("unacked"))
        counts["unacked_index"] = int(r.zcard("unacked_index"))
        return counts

    def wait_drained(self, timeout: float = 30.0) -> None:
        """Until no message is queued or unacknowledged (two looks in a row, workers idle)."""
        timeout *= WAIT_SCALE
        deadline = time.monotonic() + timeout
        clean_looks = 0
        while True:
            backlog = self.broker_backlog()
            clean_looks = clean_looks + 1 if not any(backlog.values()) else 0
            if clean_looks >= 2:
                return
            if time.monotonic() >= deadline:
                pytest.fail(f"broker not drained after {timeout}s: {backlog}\n{self.tails()}")
            time.sleep(0.25)

    def unacked(self, run_id: str | None = None, key: str | None = None, attempt: int | None = None) -> list[str]:
        """The delivery tags of the unacked messages (of one run, key, attempt when given: read
        from each message's orchestrator headers)."""
        tags = []
        for raw_tag, raw in self.redis.hgetall("unacked").items():
            headers = (json.loads(raw)[0].get("headers") or {}) if raw else {}
            wanted = (("orc_run", run_id), ("orc_key", key), ("orc_attempt", attempt))
            if all(v is None or headers.get(h) == v for h, v in wanted):
                tags.append(raw_tag.decode() if isinstance(raw_tag, bytes) else str(raw_tag))
        return tags

    def restore_unacked(self, run_id: str | None = None, key: str | None = None, attempt: int | None = None) -> int:
        """Redeliver the unacked messages now (of one run, key, attempt when given), as kombu
        does once ``visibility_timeout`` passed (a SIGKILLed worker cannot ack or restore them;
        production waits the timeout); returns how many. Without a filter, call it only while the
        live workers are idle: their own unacked deliveries would be restored too.

        Each message is restored by its tag (kombu's ``restore_by_tag``, a WATCHed transaction),
        not through ``restore_visible``: that one silently does nothing while a worker's own
        periodic restore holds kombu's mutex, which a loaded machine made long enough to lose
        a test's redelivery."""
        from kombu import Connection

        tags = self.unacked(run_id, key, attempt)
        with Connection(self.redis_server.url, transport_options={"visibility_timeout": 0}) as conn:
            qos = conn.default_channel.qos
            for tag in tags:
                qos.restore_by_tag(tag)
        return len(tags)

    # -- the promise

    def assert_clean(self, run_ids: Iterable[str], *, allow_dead_letter: bool = False) -> None:
        """The checks every scenario ends with: the DB-only invariants hold and the broker is empty."""
        ids = list(run_ids)
        problems = check_runs(self.store, ids, allow_dead_letter=allow_dead_letter)
        assert problems == [], problems
        self.wait_drained()
        # late duplicates processed while draining must not have broken anything either
        problems = check_runs(self.store, ids, allow_dead_letter=allow_dead_letter)
        assert problems == [], problems


# ---------------------------------------------------------------------------- event queries


def accepted(
    events: Iterable[Any], *, src: str | None = None, dst: str | None = None, actor: str | None = None
) -> list[Any]:
    return [e for e in events if e.accepted and _match(e, src, dst, actor)]


def rejected(
    events: Iterable[Any], *, src: str | None = None, dst: str | None = None, actor: str | None = None
) -> list[Any]:
    return [e for e in events if not e.accepted and _match(e, src, dst, actor)]


def _match(e: Any, src: str | None, dst: str | None, actor: str | None) -> bool:
    return (
        (src is None or e.from_state == src)
        and (dst is None or e.to_state == dst)
        and (actor is None or e.actor == actor)
    )


def republished(events: Iterable[Any]) -> Counter[tuple[str, int]]:
    """Accepted QUEUED -> QUEUED re-publications per (key, attempt)."""
    return Counter((e.key, e.attempt) for e in accepted(events, src="QUEUED", dst="QUEUED", actor="reconciler"))


def republished_once_per_timeout(events: Iterable[Any], dispatch_timeout: float) -> dict[tuple[str, int], int]:
    """The accepted re-publications per (key, attempt), asserting that no message was re-published
    twice for one lapse of the dispatch timeout (each re-publish of a row a dispatch timeout or
    more after the one before): a second one after another full timeout is the reconciler doing
    its job on a loaded machine whose worker took that long to claim, not a double."""
    times: dict[tuple[str, int], list[Any]] = {}
    for e in accepted(events, src="QUEUED", dst="QUEUED", actor="reconciler"):
        times.setdefault((e.key, e.attempt), []).append(e.at)
    for k, ats in times.items():
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ats)]
        assert all(g >= dispatch_timeout for g in gaps), f"{k} re-published twice in one dispatch timeout: {gaps}"
    return {k: len(ats) for k, ats in times.items()}


def worker_pid(task: Any) -> int:
    """The pool process running a task, from its ``worker`` column ``<hostname>:<pid>``."""
    assert task.worker, f"{task.key} has no worker yet"
    return int(task.worker.rsplit(":", 1)[1])


def write_spec(dag: DAG, path: Path) -> Path:
    path.write_text(json.dumps(dag.to_spec()))
    return path


def log_clock_offset(text: str) -> float | None:
    """Seconds between the last Celery log timestamp in ``text`` and this process's clock."""
    stamp = None
    for line in text.splitlines():
        if line.startswith("[") and ": " in line:
            with contextlib.suppress(ValueError):
                stamp = dt.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    if stamp is None:
        return None
    return (stamp - dt.datetime.now()).total_seconds()


# ---------------------------------------------------------------------------- alert receiver


class Webhook:
    """A tiny HTTP server on 127.0.0.1 that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextlib.contextmanager
def webhook() -> Iterator[Webhook]:
    with Webhook() as hook:
        yield hook


def task_states(cluster: Cluster, run_id: str) -> dict[str, TaskState]:
    return {t.key: t.state for t in cluster.store.reads.get_tasks(run_id)}
