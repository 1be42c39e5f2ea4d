"""``orchestrator chaos``: a soak that runs many DAGs on a real local deployment while faults
are injected at random, then proves from the database that nothing was lost or committed twice.

It starts, on this machine only and on 127.0.0.1 only: a private PostgreSQL server on a temp
data directory (unless ``database_url`` names a database to use instead), a private
redis-server, N prefork Celery workers and a reconciler loop, plus small TCP relays in this
process: one between the workers (and the reconciler) and Redis, one per worker between that
worker and Postgres. Worker ``chaos0`` runs under libfaketime with a time file this module
rewrites. Eleven kinds of fault:

- ``kill_child``: a pool child killed (-9); ``kill_worker``: a whole worker killed (-9) and
  restarted; ``pause_worker``: a worker paused past its lease (SIGSTOP, SIGCONT 2.5-3.5 s later);
- ``redis_restart`` (SHUTDOWN NOSAVE, started again) and ``redis_flush`` (FLUSHALL);
- ``broker_cut``: the broker relay drops every connection and refuses new ones for 2-5 s, then
  forwards again (Redis itself keeps running);
- ``pg_terminate``: the application's Postgres backends terminated; ``pg_restart``: the private
  server stopped (fast: every session ended) and started again 1-3 s later (private server only);
- ``pg_partition``: one worker's Postgres relay blackholes for 3-5 s (more than the 2 s lease):
  nothing passes either way, connections hang, then heal and carry on;
- ``clock_jump``: worker ``chaos0``'s wall clock jumps by 1-10 minutes, forward or back (its
  monotonic clock stays real, as a real jump leaves it: :func:`skewed_env`);
- ``duplicate_publish``: a queued or running task's message published a second time.

About two DAGs in five also wait (``orchestrator.core.waits``): an event wait with a match, a short
sleep, a body that raises ``Defer`` until its event, sometimes a sensor whose check says "not yet"
a few times. The soak emits their events (and a decoy that matches nothing) a random 0-3 s after
the submit, while the faults go on: retried through a fault under the same event id.

The faults are dealt from a shuffled deck (every kind once per round) so every kind is
injected early and about as often; a fault that lasts (a pause, a cut, a partition, a restart)
is healed later by the main loop while other faults go on.

With ``mix`` (``--mix N``, the interaction soak) the same runs also get operator actions,
approvals, a foreign tenant's events, a breaker opened, schedule and trigger firings and ``db
clean`` (:mod:`orchestrator.testing.mix`); their DAGs grow approvals and a resource, their maps are
inserted 8 children at a time, and a third worker runs without ``tasks.dynamic``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ..core import dag as dag_module
from ..core.dag import DAG
from ..core.protocol import FencingToken, send_options, sign
from ..engine.facade import Orchestrator
from ..store import Store, make_engine, migrate
from .mix import Mixer, run_states

ROOT = Path(__file__).resolve().parents[1]
P = "tasks.probes."
D = "tasks.dynamic."
#: the worker whose clock jumps
SKEWED = "chaos0"
#: the worker (``--mix``) started without one of the task modules (as after a deploy that
#: forgot it): the tasks of that module it receives it does not have
LACKING = "chaos-lacking"
LACKED_MODULE = "tasks.dynamic"
DEFAULT_MODULES = ("tasks.probes", "tasks.etl", "tasks.dynamic")
#: ``--mix``: maps insert their children this many at a time (``dag.MAP_WINDOW``), so the soak's
#: maps of 20 and 30 items are wider than one insert window
MIX_MAP_WINDOW = 8
#: ``--mix``: the resource whose circuit breaker the actions open and close
RESOURCE = "chaos-res"
LIBFAKETIME = [
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
    Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
    Path("/usr/local/lib/faketime/libfaketimeMT.so.1"),
]
#: every kind of fault; ``kill_child`` twice, as before: it is the commonest crash
DECK = ["kill_child", "kill_child", "kill_worker", "pause_worker", "redis_restart", "redis_flush", "broker_cut",
        "pg_terminate", "pg_restart", "pg_partition", "clock_jump", "duplicate_publish"]  # fmt: skip
KINDS = sorted(set(DECK))


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


def libfaketime() -> Path | None:
    """libfaketime's multi-threaded preload library, if installed (``apt-get install faketime``)."""
    return next((p for p in LIBFAKETIME if p.exists()), None)


#: the skewed worker's ``sitecustomize``: ``time.sleep`` as relative ``select`` timeouts (see
#: :func:`skewed_env`)
SLEEP_SHIM = """\
# written by orchestrator.testing.chaos for the worker whose wall clock jumps (libfaketime)
import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


time.sleep = _sleep
"""


def skewed_env(lib: Path, clock_file: Path, data: Path, pythonpath: str) -> dict[str, str]:
    """The environment of the worker whose wall clock jumps: libfaketime preloaded, reading its
    offset from ``clock_file``, with the monotonic clock left real, as a real clock jump leaves it.

    libfaketime 0.9.10 cannot fake the wall clock alone for Python 3.11 and later both ways:
    with the monotonic clock faked (its default) every timed wait of a thread (``Event.wait(t)``,
    ``Lock.acquire(timeout=t)``: ``sem_clockwait`` on CLOCK_MONOTONIC, which it does not
    intercept) gets a deadline of about 1.8e9 s and never wakes (wolfcw/libfaketime#390): the
    worker's registry and reconciler threads stopped at their first wait, its capacity row went
    stale and the soak reported every run after it lost and stuck; with
    ``FAKETIME_DONT_FAKE_MONOTONIC=1`` ``time.sleep`` (an absolute ``clock_nanosleep``) fails
    with EINVAL (wolfcw/libfaketime#426). So the monotonic clock is left real and a
    ``sitecustomize`` written under ``data`` makes ``time.sleep`` relative ``select`` timeouts."""
    shim = data / "skewed-site"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    return {
        "LD_PRELOAD": str(lib),
        "FAKETIME_TIMESTAMP_FILE": str(clock_file),
        "FAKETIME_CACHE_DURATION": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(shim), pythonpath) if p),
    }


class PrivatePostgres:
    """A PostgreSQL server of the soak's own: a temp data directory, a free 127.0.0.1 port, so
    restarting it touches nothing else. The Debian server binaries
    (``/usr/lib/postgresql/<version>/bin``, else ``pg_ctl`` on the ``PATH``); as root they run
    as the ``postgres`` user (the server refuses to run as root)."""

    def __init__(self) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
        which = shutil.which("pg_ctl")
        if not found and which is None:
            raise RuntimeError(
                "no pg_ctl: the chaos soak's private Postgres needs the server binaries"
                " (apt-get install postgresql), or give --database-url"
            )
        self.bin = found[-1].parent if found else Path(str(which)).parent
        self.root = Path(tempfile.mkdtemp(prefix="orc-chaos-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._user = ["runuser", "-u", "postgres", "--"]
        os.chmod(self.root, 0o755)
        self.running = False

    def _run(self, *cmd: str, timeout: float = 60.0) -> None:
        done = subprocess.run([*self._user, *cmd], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {done.stdout}{done.stderr}{tail}")

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
                   " -c synchronous_commit=off -c max_connections=300")  # fmt: skip
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        self.running = False
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class Relay:
    """A TCP relay on 127.0.0.1 to an upstream 127.0.0.1 port, run on the :class:`Relays` loop.

    ``cut(seconds)``: every connection dropped (reset) and the port refused, then listening
    again. ``blackhole(True)``: nothing passes either way (bytes wait in the sockets, new
    connections wait to be served) until ``blackhole(False)``: a partition, then healing."""

    def __init__(self, name: str, upstream: tuple[str, int]) -> None:
        self.name, self.upstream = name, upstream
        self.port = free_port()
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.flowing: asyncio.Event | None = None

    async def open(self) -> None:
        if self.flowing is None:
            self.flowing = asyncio.Event()
            self.flowing.set()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.flowing is not None
        self.writers.add(writer)
        try:
            await self.flowing.wait()
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
            except (TimeoutError, OSError):
                return
            self.writers.add(up_writer)
            try:
                pumps = [asyncio.ensure_future(self._pump(reader, up_writer)),
                         asyncio.ensure_future(self._pump(up_reader, writer))]  # fmt: skip
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                for pump in pumps:
                    pump.cancel()
            finally:
                self.writers.discard(up_writer)
                up_writer.close()
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.flowing is not None
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()

    async def drop_all(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()

    async def set_flowing(self, flowing: bool) -> None:
        assert self.flowing is not None
        if flowing:
            self.flowing.set()
        else:
            self.flowing.clear()


class Relays:
    """The relays' event loop, on a daemon thread of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-relays", daemon=True)
        self.thread.start()
        self.relays: list[Relay] = []

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def add(self, name: str, upstream: tuple[str, int]) -> Relay:
        relay = Relay(name, upstream)
        self.call(relay.open())
        self.relays.append(relay)
        return relay

    def cut(self, relay: Relay) -> None:
        """Drop every connection and refuse new ones (until :meth:`reopen`)."""
        self.call(relay.drop_all())

    def reopen(self, relay: Relay) -> None:
        self.call(relay.open())

    def blackhole(self, relay: Relay, on: bool) -> None:
        self.call(relay.set_flowing(not on))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for relay in self.relays:
                self.call(relay.set_flowing(True))
                self.call(relay.drop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Deployment:
    database_url: str
    workers: int
    data: Path
    redis_port: int = field(default_factory=free_port)
    redis: subprocess.Popen[bytes] | None = None
    worker_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    reconciler: subprocess.Popen[bytes] | None = None
    #: the private server, when the soak runs its own (``pg_restart`` needs it)
    pg: PrivatePostgres | None = None
    relays: Relays | None = None
    broker_relay: Relay | None = None
    pg_relays: dict[str, Relay] = field(default_factory=dict)
    #: worker ``chaos0``'s libfaketime time file (``+0``, ``-7m``...), when libfaketime is installed
    clock_file: Path | None = None
    #: ORCHESTRATOR_CLAIM_DELAY of the workers (0: claim before every body)
    claim_delay: float = 0.0
    #: also run worker ``LACKING``, started without one task module (``--mix``)
    lacking: bool = False

    @property
    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self, *, database_url: str | None = None, broker_port: int | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        env.update(
            ORCHESTRATOR_DATABASE_URL=database_url or self.database_url,
            ORCHESTRATOR_BROKER_URL=f"redis://127.0.0.1:{broker_port or self.redis_port}/0",
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
            ORCHESTRATOR_CLAIM_DELAY=str(self.claim_delay),
            PYTHONPATH=str(ROOT),
        )
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.data / f"{name}.log").open("ab")
        return subprocess.Popen(cmd, cwd=ROOT, env=env or self.env(), stdout=log, stderr=subprocess.STDOUT,
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

    def _relayed_url(self, relay: Relay | None) -> str | None:
        if relay is None:
            return None
        return (
            sa.engine.make_url(self.database_url)
            .set(host="127.0.0.1", port=relay.port)
            .render_as_string(hide_password=False)
        )

    def start_worker(self, name: str) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "config.celery_app", "worker", "--pool", "prefork", "-c", "2",
               "--without-gossip", "--without-mingle", "--loglevel", "INFO", "-n", f"{name}@%h"]  # fmt: skip
        broker_port = self.broker_relay.port if self.broker_relay else None
        env = self.env(database_url=self._relayed_url(self.pg_relays.get(name)), broker_port=broker_port)
        if name == LACKING:
            env["ORCHESTRATOR_TASK_MODULES"] = ",".join(m for m in DEFAULT_MODULES if m != LACKED_MODULE)
        lib = libfaketime()
        if name == SKEWED and self.clock_file is not None and lib is not None:
            env.update(skewed_env(lib, self.clock_file, self.data, env.get("PYTHONPATH", "")))
        self.worker_procs[name] = self._spawn(name, cmd, env)

    def start_reconciler(self) -> None:
        cmd = [sys.executable, "-m", "orchestrator.cli", "reconcile", "--interval", "0.3"]
        broker_port = self.broker_relay.port if self.broker_relay else None
        self.reconciler = self._spawn("reconciler", cmd, self.env(broker_port=broker_port))

    def start(self) -> None:
        self.start_redis()
        self.relays = Relays()
        self.broker_relay = self.relays.add("broker", ("127.0.0.1", self.redis_port))
        url = sa.engine.make_url(self.database_url)
        if url.host and "host" not in url.query:  # a TCP server: one relay per worker (a Unix socket: none)
            for i in range(self.workers):
                self.pg_relays[f"chaos{i}"] = self.relays.add(f"pg-chaos{i}", (url.host, url.port or 5432))
        if libfaketime() is not None:
            self.clock_file = self.data / "clock"
            self.clock_file.write_text("+0\n")
        for i in range(self.workers):
            self.start_worker(f"chaos{i}")
        if self.lacking:
            self.start_worker(LACKING)
        self.start_reconciler()

    def supervise(self) -> list[str]:
        """Restart a worker or the reconciler that exited by itself (as a service manager
        would); the names restarted."""
        restarted = []
        for name, proc in list(self.worker_procs.items()):
            if proc.poll() is not None:
                self.start_worker(name)
                restarted.append(name)
        if self.reconciler is not None and self.reconciler.poll() is not None:
            self.start_reconciler()
            restarted.append("reconciler")
        return restarted

    def retire(self, name: str) -> None:
        """Stop worker ``name`` for good (warm shutdown: it unregisters, and the tasks it dropped as
        unregistered are released); :meth:`supervise` no longer restarts it."""
        proc = self.worker_procs.pop(name, None)
        if proc is not None:
            stop_group(proc)

    def stop(self) -> None:
        for proc in [*self.worker_procs.values(), self.reconciler, self.redis]:
            if proc is not None:
                stop_group(proc)
        if self.relays is not None:
            self.relays.close()

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


#: after the last fault and the last action, every run final within this many seconds (or
#: waiting on something ``explain`` names); past it the rest counts as stuck
SETTLE_SECONDS = 180.0
#: the retry options of every soak task: a fault costs an attempt, never the run
RETRY: dict[str, Any] = {"max_attempts": 10, "backoff": {"base": 0.2, "cap": 1.0}}
#: the shapes a soak DAG takes beyond its plain probe nodes (``plain``: none)
SHAPES = ("plain", "map", "branch", "skip")
#: the share of soak DAGs that also wait (events, a sleep, a deferred body, a sensor)
WAITING_SHARE = 0.4


def random_dag(rng: random.Random, i: int, mixed: bool = False) -> DAG:
    """A random DAG of 2-10 probe tasks (``sleep``, ``flaky``, ``echo``, ``noop``) that may grow,
    below them, a map over a listing's result (sometimes chained, bounded by max_active, empty,
    with children that skip themselves; joined under a random trigger rule), a branch, or tasks
    that skip (``orchestrator.Skip``, a short circuit) with children of several rules."""
    dag = DAG(f"chaos-{i}", tenant=rng.choice(["acme", "globex", "initech"]))
    keys: list[str] = []
    for n in range(rng.randint(2, 10)):
        ups = rng.sample(keys, k=min(len(keys), rng.randint(0, 2))) if keys else []
        kind = rng.random()
        if kind < 0.35:
            dag.task(f"n{n}", P + "sleep", kwargs={"seconds": round(rng.uniform(0.05, 0.6), 2)}, upstream=ups,
                     **RETRY)  # fmt: skip
        elif kind < 0.5:
            dag.task(f"n{n}", P + "flaky", kwargs={"fail_times": rng.randint(1, 2)}, upstream=ups, **RETRY)
        else:
            dag.task(f"n{n}", P + ("echo" if kind < 0.75 else "noop"), upstream=ups, **RETRY)
        keys.append(f"n{n}")
    shape = rng.choice(SHAPES)
    above = rng.sample(keys, k=rng.randint(0, 1))
    if shape == "map":
        _mapped(dag, rng, above)
    elif shape == "branch":
        _branching(dag, rng, above)
    elif shape == "skip":
        _skipping(dag, rng, above)
    if rng.random() < WAITING_SHARE:
        _waiting(dag, rng, rng.sample(keys, k=rng.randint(0, 1)), i)
    if mixed:
        _mixed(dag, random.Random(f"mix-{i}-{rng.random()}"), keys)
    return dag


def _mixed(dag: DAG, rng: random.Random, keys: list[str]) -> None:
    """``--mix``'s extra nodes: an approval (``ok``: the soak answers it) with a child, and a
    task using the resource whose breaker the soak opens and closes."""
    if rng.random() < 0.3:
        ok = dag.approval("ok", upstream=rng.sample(keys, k=rng.randint(0, 1)))
        dag.task("approved", P + "echo", upstream=[ok], trigger_rule="all_done", **RETRY)
    if rng.random() < 0.3:
        dag.task("res", P + "echo", resources=[RESOURCE], upstream=rng.sample(keys, k=rng.randint(0, 1)), **RETRY)


def _mapped(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """ls -> m (one child per item of ls's result) [-> m2, item by item] -> join."""
    n = rng.choice([0, 1, 3, 8, 20, 30])
    ls = dag.task("ls", D + "listing", kwargs={"n": n, "seconds": round(rng.uniform(0.0, 0.3), 2)}, upstream=above,
                  **RETRY)  # fmt: skip
    item = {"seconds": round(rng.uniform(0.0, 0.2), 2), "skip_every": rng.choice([0, 0, 0, 4])}
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs=item, on_empty=rng.choice(["skip", "success"]),
                max_active=rng.choice([None, None, 3]), **RETRY)  # fmt: skip
    last = m
    if rng.random() < 0.4:  # a chained map: each item's second stage as soon as its first is done
        last = dag.map("m2", D + "item", over=m, kwarg="x", kwargs={"add": 1}, **RETRY)
    rule = rng.choice(["all_success", "all_done", "none_failed", "one_success", "none_failed_min_one_success"])
    ratio = 0.5 if rule == "all_success" and rng.random() < 0.5 else None
    dag.task("join", D + "collect", upstream=[last], trigger_rule=rule, min_success_ratio=ratio, **RETRY)


def _branching(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """pick (a branch) -> a / b / c, d below b; the paths joined by none_failed_min_one_success."""
    paths = ["a", "b", "c"]
    chosen = rng.sample(paths, k=rng.randint(1, 2))
    pick = dag.task("pick", D + "choose", kwargs={"pick": chosen if len(chosen) > 1 else chosen[0]},
                    upstream=above, branch=True, **RETRY)  # fmt: skip
    a = dag.task("a", P + "sleep", kwargs={"seconds": round(rng.uniform(0.05, 0.4), 2)}, upstream=[pick], **RETRY)
    b = dag.task("b", P + "echo", upstream=[pick], **RETRY)
    c = dag.task("c", P + "flaky", kwargs={"fail_times": 1}, upstream=[pick], **RETRY)
    d = dag.task("d", P + "noop", upstream=[b], **RETRY)
    dag.task("paths", P + "echo", upstream=[a, c, d], trigger_rule="none_failed_min_one_success", **RETRY)


def _skipping(dag: DAG, rng: random.Random, above: list[str]) -> None:
    """A task that raises Skip and a short circuit (a falsy result), each with children of several rules."""
    s = dag.task("s", D + "skip", kwargs={"reason": "nothing new"}, upstream=above, **RETRY)
    dag.task("s_strict", P + "noop", upstream=[s], **RETRY)  # SKIPPED: upstream_skipped
    dag.task("s_tolerant", P + "echo", upstream=[s], trigger_rule="none_failed", **RETRY)
    dag.task("s_all_skipped", P + "noop", upstream=[s], trigger_rule="all_skipped", **RETRY)
    gate = dag.task("gate", D + "item", kwargs={"x": rng.choice([0, 1])}, short_circuit=True, **RETRY)
    after = dag.task("gated", P + "sleep", kwargs={"seconds": 0.1}, upstream=[gate], **RETRY)
    dag.task("gated_after", P + "noop", upstream=[after], **RETRY)


def _waiting(dag: DAG, rng: random.Random, above: list[str], i: int) -> None:
    """ev (an event wait with a match), nap (a short sleep), df (a body deferring until its
    event, with a saved state), sometimes a sensor; ``woken`` below them (their results)."""
    ev = dag.wait("ev", event=f"chaos.{i}", match={"i": i}, upstream=above)
    nap = dag.wait("nap", delay=round(rng.uniform(0.1, 2.0), 2), upstream=above)
    df = dag.task("df", P + "deferring", kwargs={"event": f"chaos.{i}.resume", "match": {"i": i}, "state": {"i": i},
                  "seconds": round(rng.uniform(0.0, 0.3), 2)}, upstream=above, **RETRY)  # fmt: skip
    waits = [ev, nap, df]
    if rng.random() < 0.5:
        # (a sensor's backoff is its interval's factor: its retries back off by the default)
        waits.append(dag.sensor("sense", P + "not_yet", kwargs={"times": rng.randint(0, 2)}, every=0.3,
                                backoff=1.5, upstream=above, max_attempts=RETRY["max_attempts"]))  # fmt: skip
    dag.task("woken", P + "echo", upstream=waits, **RETRY)


@dataclass(frozen=True)
class Emit:
    """An event the soak emits for a waiting DAG (``event_id`` makes a retry a duplicate)."""

    key: str
    payload: dict[str, Any]
    tenant: str
    event_id: str


def emits_for(dag: DAG, event_id: str) -> list[Emit]:
    """The events that wake ``dag``'s event waits and deferred bodies (each payload its match
    and more), plus a decoy per key that matches none of them."""
    out: list[Emit] = []
    for node in dag.nodes.values():
        if node.wait is not None and node.wait.kind == "event" and node.wait.event is not None:
            key, match = node.wait.event, dict(node.wait.match or {})
        elif node.task == P + "deferring":
            key, match = str(node.kwargs["event"]), dict(node.kwargs.get("match") or {})
        else:
            continue
        out.append(Emit(key, {**match, "from": "chaos"}, dag.tenant, f"{event_id}-{node.key}"))
        out.append(Emit(key, {"i": -1, "decoy": True}, dag.tenant, f"{event_id}-{node.key}-decoy"))
    return out


@dataclass
class Fault:
    kind: str
    #: when the fault stopped acting (monotonic); ``None`` while it lasts
    healed_at: float | None = None
    #: the progress mark (last committed task's event id) when it healed
    mark: int = 0
    #: seconds from healing to the next task committed anywhere
    recovery: float | None = None


@dataclass
class Heal:
    at: float
    kind: str
    action: Callable[[], None]
    fault: Fault
    tries: int = 0


class Injector:
    """Deals faults from a shuffled deck, one at a time, and heals the lasting ones on time."""

    def __init__(self, dep: Deployment, orc: Orchestrator, rng: random.Random, echo: Callable[[str], None]) -> None:
        self.dep, self.orc, self.rng, self.echo = dep, orc, rng, echo
        self.counts: Counter[str] = Counter()
        self.last_fault = time.monotonic()
        self.deck: list[str] = []
        self.heals: list[Heal] = []
        self.faults: list[Fault] = []
        #: the last task-commit mark seen (``orc_task_events.id`` of a SUCCEEDED transition)
        self.mark = 0
        available = set(DECK)
        if dep.pg is None:
            available.discard("pg_restart")  # never restart a server the soak does not own
        if not dep.pg_relays:
            available.discard("pg_partition")
        if dep.clock_file is None:
            available.discard("clock_jump")
        self.available = available

    @property
    def db_down(self) -> bool:
        return self.dep.pg is not None and not self.dep.pg.running

    def lasting(self) -> set[str]:
        return {h.kind for h in self.heals}

    def _draw(self) -> str | None:
        blocked = self.lasting()
        if self.db_down or "pg_restart" in blocked:
            blocked |= {"pg_terminate", "duplicate_publish"}
        if "pause_worker" in blocked or "pg_partition" in blocked:
            blocked |= {"pause_worker", "pg_partition"}  # one worker out at a time, not all
        if not self.deck:
            self.deck = [k for k in DECK if k in self.available]
            self.rng.shuffle(self.deck)
        for i, kind in enumerate(self.deck):
            if kind not in blocked:
                return self.deck.pop(i)
        return None

    def inject(self) -> None:
        kind = self._draw()
        if kind is None:
            return
        fault = Fault(kind)
        heal = getattr(self, kind)()
        if heal is None:
            self._healed(fault)
        else:
            delay, action = heal
            self.heals.append(Heal(time.monotonic() + delay, kind, action, fault))
        self.faults.append(fault)
        self.counts[kind] += 1
        self.last_fault = time.monotonic()

    def _healed(self, fault: Fault) -> None:
        fault.healed_at = time.monotonic()
        fault.mark = self.mark

    def heal_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        for heal in [h for h in self.heals if everything or h.at <= now]:
            try:
                heal.action()
            except Exception as exc:  # noqa: BLE001 - try again in a second
                heal.tries += 1
                self.echo(f"healing {heal.kind} failed ({exc!r}); retrying")
                heal.at = now + 1.0
                if heal.tries < 30:
                    continue
            self.heals.remove(heal)
            self._healed(heal.fault)
            self.last_fault = time.monotonic()

    def observe(self, mark: int) -> None:
        """A new progress mark: every healed fault still waiting for a commit has recovered."""
        if mark <= self.mark:
            return
        now = time.monotonic()
        for fault in self.faults:
            if fault.recovery is None and fault.healed_at is not None and fault.mark < mark:
                fault.recovery = now - fault.healed_at
        self.mark = mark

    def children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        try:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        except OSError:
            return []
        return [int(x) for x in out.stdout.split()]

    def _worker(self) -> tuple[str, subprocess.Popen[bytes]]:
        name = self.rng.choice(sorted(self.dep.worker_procs))
        return name, self.dep.worker_procs[name]

    # -- the faults: each returns None, or (seconds, how to heal) for a fault that lasts

    def kill_child(self) -> None:
        _, proc = self._worker()
        kids = self.children(proc)
        if kids:
            os.kill(self.rng.choice(kids), signal.SIGKILL)

    def kill_worker(self) -> None:
        name, proc = self._worker()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.dep.start_worker(name)

    def pause_worker(self) -> tuple[float, Callable[[], None]]:
        _, proc = self._worker()
        os.killpg(proc.pid, signal.SIGSTOP)

        def resume() -> None:
            if proc.poll() is None:  # not killed (and reaped) meanwhile
                os.killpg(proc.pid, signal.SIGCONT)

        return 2.5 + self.rng.random(), resume  # past the 2 s lease

    def redis_restart(self) -> None:
        self.dep._redis_cmd("SHUTDOWN", "NOSAVE")
        if self.dep.redis is not None:
            self.dep.redis.wait(10)
        time.sleep(0.5)
        self.dep.start_redis()

    def redis_flush(self) -> None:
        self.dep._redis_cmd("FLUSHALL")

    def broker_cut(self) -> tuple[float, Callable[[], None]]:
        relays, relay = self.dep.relays, self.dep.broker_relay
        assert relays is not None and relay is not None
        relays.cut(relay)
        return 2.0 + 3.0 * self.rng.random(), lambda: relays.reopen(relay)

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

    def pg_restart(self) -> tuple[float, Callable[[], None]]:
        pg = self.dep.pg
        assert pg is not None
        pg.stop("fast")
        return 1.0 + 2.0 * self.rng.random(), pg.start

    def pg_partition(self) -> tuple[float, Callable[[], None]]:
        relays = self.dep.relays
        assert relays is not None
        relay = self.dep.pg_relays[self.rng.choice(sorted(self.dep.pg_relays))]
        relays.blackhole(relay, True)
        return 3.0 + 2.0 * self.rng.random(), lambda: relays.blackhole(relay, False)

    def clock_jump(self) -> None:
        assert self.dep.clock_file is not None
        minutes = self.rng.randint(1, 10) * self.rng.choice([1, -1])
        tmp = self.dep.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{minutes:+d}m\n")
        tmp.replace(self.dep.clock_file)  # libfaketime never reads half a file

    def duplicate_publish(self) -> None:
        found = self.orc.reads.in_flight(1)
        if not found:
            return
        row = found[0]
        token = FencingToken(row.run_id, row.key, row.attempt)
        signature = sign(self.orc.signing_key, row.task_name, token)
        options = send_options(token, queue=row.queue, soft_time_limit=None, time_limit=None, signature=signature)
        self.orc.app.send_task(row.task_name, **options)


PROGRESS = sa.text(
    "SELECT coalesce(max(id), 0) FROM orc_task_events WHERE to_state = 'SUCCEEDED' AND accepted AND key IS NOT NULL"
)


def run_chaos(
    *,
    runs: int,
    seed: int,
    database_url: str | None = None,
    workers: int = 2,
    min_faults: int = 0,
    fault_interval: float = 0.6,
    timeout: float = 900.0,
    claim_delay: float = 0.0,
    mix: int = 0,
    action_interval: float = 0.8,
    settle: float = SETTLE_SECONDS,
    lacking: bool = True,
    echo: Callable[[str], None] = print,
) -> int:
    """Run the soak; print the report; return 0 only if no invariant was broken (nothing lost,
    stuck or committed twice, no illegal transition, no child started before its parent).

    At least ``runs`` runs are driven; more are submitted while fewer than ``min_faults`` faults
    have been injected, so every fault lands on a busy deployment. Without ``database_url`` the
    soak runs its own PostgreSQL server (and may restart it); with one, that database is wiped
    and every kind but ``pg_restart`` is injected. ``claim_delay``: the workers'
    ``ORCHESTRATOR_CLAIM_DELAY`` (direct messages' bodies run before their claim).

    ``mix``: at least this many operator actions (:mod:`orchestrator.testing.mix`) at random moments,
    one every ``action_interval`` seconds or so, while the faults go on; the runs they start
    are followed too. After the last fault and the last action every run must be final within
    ``settle`` seconds, or wait on something ``explain`` names; past it the soak stops waiting and
    counts the rest as stuck. ``lacking``: with ``mix``, also run a worker without one task
    module.
    """
    # two generators, so the DAGs do not depend on how the faults interleave with them
    rng = random.Random(seed)
    fault_rng = random.Random(seed + 1_000_003)
    emit_rng = random.Random(seed + 2_000_003)  # when the events come
    mix_rng = random.Random(seed + 3_000_003)  # which actions, at what
    data = Path(tempfile.mkdtemp(prefix="orc-chaos-"))
    pg: PrivatePostgres | None = None
    dep: Deployment | None = None
    orc: Orchestrator | None = None
    probe: sa.Engine | None = None
    report: dict[str, Any] = {}
    previous = None
    window = dag_module.MAP_WINDOW
    if mix:
        dag_module.MAP_WINDOW = MIX_MAP_WINDOW  # read when a submit writes a map's row
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (``timeout``, a test giving up) ends the soak through ``finally``: every
        # process it started is stopped, by its process group
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        if database_url is None:
            pg = PrivatePostgres()
            pg.init()
            pg.start()
            database_url = pg.url
        dep = Deployment(database_url, workers, data, pg=pg, claim_delay=claim_delay, lacking=bool(mix) and lacking)
        engine = make_engine(database_url)
        migrate.reset(engine)
        engine.dispose()
        # this process (submits, checks, duplicate publishes) talks to Redis and Postgres directly
        for k, v in dep.env().items():
            os.environ[k] = v
        from ..runtime.celery_app import get_app

        orc = Orchestrator(app=get_app(), store=Store(database_url))
        probe = make_engine(database_url)
        started = time.monotonic()
        dep.start()
        injector = Injector(dep, orc, fault_rng, echo)
        mixer = Mixer(orc, mix_rng, echo, resource=RESOURCE) if mix else None
        if mixer is not None:
            mixer.setup()
        run_ids: list[str] = []
        next_action = time.monotonic() + 3.0
        Deployment._wait(lambda: _live_workers(orc) >= len(dep.worker_procs), "workers", 90)
        next_fault = time.monotonic() + 2.0
        next_look = 0.0
        finished = 0
        restarts = 0
        pending = list(range(runs))
        #: the next DAG index (and idempotency key) of a run added to keep the deployment busy;
        #: never reused, even once ``db clean`` removed runs
        extra = runs
        #: (when, event) emits due: each waiting DAG's events, a little after its submit
        emits: list[tuple[float, Emit]] = []
        emitted = woken = 0
        drawn: dict[int, DAG] = {}
        while time.monotonic() - started < timeout:
            injector.heal_due()
            for name in dep.supervise():
                echo(f"{name} exited; restarted")
                restarts += 1
            up = not injector.db_down
            if up and time.monotonic() >= next_look:
                finished = _finished(orc, run_ids)
                with contextlib.suppress(sa.exc.DBAPIError):
                    with probe.connect() as conn:
                        injector.observe(int(conn.execute(PROGRESS).scalar_one()))
                next_look = time.monotonic() + 0.25
            if up and pending and len(run_ids) - finished < 8:
                i = pending.pop(0)
                # a submit a fault interrupted is tried again with the same DAG and key
                dag = drawn.pop(i, None) or random_dag(rng, i, mixed=bool(mix))
                try:
                    run_ids.append(orc.submit(dag, idempotency_key=f"chaos-{seed}-{i}").id)
                    now = time.monotonic()
                    emits += [(now + 3.0 * emit_rng.random(), e) for e in emits_for(dag, f"chaos-{seed}-{i}")]
                except Exception as exc:  # noqa: BLE001 - a fault hit the submit; retry the same key later
                    echo(f"submit {i} failed during a fault ({type(exc).__name__}); retrying")
                    pending.insert(0, i)
                    drawn[i] = dag
                    time.sleep(0.5)
            if up and emits:
                due = [pair for pair in emits if pair[0] <= time.monotonic()]
                for pair in due:
                    emits.remove(pair)
                    e = pair[1]
                    try:
                        done = orc.emit(e.key, e.payload, event_id=e.event_id, tenant=e.tenant)
                    except Exception as exc:  # noqa: BLE001 - a fault hit the emit; again, same event id
                        echo(f"emit {e.key} failed during a fault ({type(exc).__name__}); retrying")
                        emits.append((time.monotonic() + 0.5, e))
                        break
                    emitted += 0 if done.duplicate else 1
                    woken += done.woken
            if mixer is not None:
                run_ids += mixer.new_runs
                mixer.new_runs.clear()
                if mixer.removed:
                    run_ids = [r for r in run_ids if r not in mixer.removed]
                if up:
                    # past the last action, a person answers the approvals left
                    mixer.tick(run_ids, answer_all=mixer.count >= mix)
                if up and mixer.count < mix and time.monotonic() >= next_action:
                    mixer.act(run_ids)
                    next_action = time.monotonic() + action_interval * (0.5 + mix_rng.random())
            enough_faults = sum(injector.counts.values()) >= min_faults
            enough_actions = mixer is None or (mixer.count >= mix and not mixer.busy)
            if not pending and not (enough_faults and enough_actions):
                # faults only mean something while there is work: keep the deployment busy
                pending.append(extra)
                extra += 1
            if time.monotonic() >= next_fault and not enough_faults:
                try:
                    injector.inject()
                except Exception as exc:  # noqa: BLE001 - a failed injection is reported, the soak goes on
                    echo(f"fault injection failed: {exc!r}")
                next_fault = time.monotonic() + fault_interval * (0.5 + rng.random())
            if enough_faults and enough_actions and not injector.heals and up:
                if LACKING in dep.worker_procs:
                    # the misconfiguration the watchdog flagged is fixed, as an operator would: the worker
                    # that lacks a task module goes; the tasks it dropped and held are released
                    echo(f"past the last fault and action: the operator stops {LACKING}")
                    dep.retire(LACKING)
                if not pending and not emits and _finished(orc, run_ids) == len(run_ids):
                    break
                quiet = time.monotonic() - max(injector.last_fault, mixer.last_action if mixer else 0.0)
                if quiet > settle:
                    echo(f"not every run final {settle:g}s after the last fault and action: giving up waiting")
                    break
            time.sleep(0.05)
        injector.heal_due(everything=True)
        # from the last fault's end (and last action's) until every run was final: how long the
        # system took to heal
        recovered = time.monotonic() - max(injector.last_fault, mixer.last_action if mixer else 0.0)
        with contextlib.suppress(sa.exc.DBAPIError):
            with probe.connect() as conn:
                injector.observe(int(conn.execute(PROGRESS).scalar_one()))
        problems = _safe_check(orc, run_ids) + (mixer.problems if mixer else [])
        # an open run whose every open task waits on something explain names is not stuck
        named = _named_waits(orc, run_ids)
        problems = [p for p in problems if not any(r in p for r in named)]
        if mixer is not None:
            problems = mixer.annotate(problems)
        report = _summary(orc, [r for r in run_ids if r not in named], problems, injector, recovered,
                          time.monotonic() - started)  # fmt: skip
        report["named_waits"] = named
        report["explained"] = _explain_open(orc, [r for r in run_ids if r not in named])
        report["settle"] = settle
        if mixer is not None:
            report["actions"] = mixer.summary(problems)
            report["removed"] = len(mixer.removed)
        report["restarts"] = restarts
        report["emitted"], report["woken"] = emitted, woken
        report["waits"] = _waits(orc, run_ids)
    finally:
        if dep is not None:
            dep.stop()
        if probe is not None:
            probe.dispose()
        if orc is not None:
            with contextlib.suppress(Exception):
                orc.store.engine.dispose()
        if pg is not None:
            pg.close()
        shutil.rmtree(data, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        dag_module.MAP_WINDOW = window
    for line in _format(report):
        echo(line)
    if not report:
        return 1
    clean = not (report["lost"] or report["committed_twice"] or report["stuck"] or report["other_violations"])
    return 0 if clean else 1


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def _live_workers(orc: Orchestrator) -> int:
    return orc.live_workers()


def _finished(orc: Orchestrator, run_ids: list[str]) -> int:
    for _ in range(5):
        try:
            return orc.reads.finished_runs(run_ids)
        except sa.exc.DBAPIError:
            time.sleep(0.2)
    return 0


def _waits(orc: Orchestrator, run_ids: list[str]) -> int:
    """Accepted transitions into WAITING (a wait began, a body deferred, a sensor said not yet)."""
    query = sa.text(
        "SELECT count(*) FROM orc_task_events WHERE run_id = ANY(:ids) AND to_state = 'WAITING' AND accepted"
    )
    for _ in range(5):
        try:
            with orc.store.engine.connect() as conn:
                return int(conn.execute(query, {"ids": run_ids}).scalar_one())
        except sa.exc.DBAPIError:
            time.sleep(0.2)
    return -1


def _named_waits(orc: Orchestrator, run_ids: list[str]) -> dict[str, str]:
    """The open runs whose every open task is WAITING on something ``explain`` names (an
    approval, an event...): run id -> what the first one waits for."""
    named: dict[str, str] = {}
    with contextlib.suppress(Exception):
        for run_id, state in run_states(orc, run_ids).items():
            if state != "RUNNING":
                continue
            found = [e for e in orc.explain(run_id) if e.state.value not in _FINAL_TASK]
            reasons = [next((r.detail for r in e.reasons if r.kind == "waiting"), None) for e in found]
            if found and all(e.state.value == "WAITING" for e in found) and all(reasons):
                named[run_id] = str(reasons[0])
    return named


def _explain_open(orc: Orchestrator, run_ids: list[str], most: int = 12) -> list[str]:
    """What ``explain`` says of the open tasks of runs not final (the first ``most``)."""
    lines: list[str] = []
    with contextlib.suppress(Exception):
        for run_id, state in run_states(orc, run_ids).items():
            if state != "RUNNING":
                continue
            for e in orc.explain(run_id):
                if e.state.value in _FINAL_TASK or e.state.value == "PENDING":
                    continue
                why = "; ".join(f"{r.kind}: {r.detail}" for r in e.reasons[:2])
                lines.append(f"{run_id}.{e.key} {e.state.value}: {why}"[:300])
                if len(lines) >= most:
                    return lines
    return lines


_FINAL_TASK = {"SUCCEEDED", "FAILED", "UPSTREAM_FAILED", "SKIPPED", "CANCELLED"}


def _safe_check(orc: Orchestrator, run_ids: list[str]) -> list[str]:
    for _ in range(5):
        try:
            return orc.verify(run_ids)
        except sa.exc.DBAPIError:
            time.sleep(0.5)
    return ["invariant check could not read the database"]


def _summary(
    orc: Orchestrator, run_ids: list[str], problems: list[str], injector: Injector, recovered: float, took: float
) -> dict[str, Any]:
    reads = orc.reads
    states = reads.task_states(run_ids)
    executions = sum(int(e[3]) for e in reads.snapshot(run_ids).effects)
    rejected = reads.rejected_events(run_ids)
    unfinished = ("PENDING", "READY", "QUEUED", "RUNNING", "RETRYING", "MAPPED", "WAITING")
    stuck = sum(n for st, n in states.items() if st in unfinished)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted(injector.counts):
        waits = [f.recovery for f in injector.faults if f.kind == kind and f.recovery is not None]
        by_kind[kind] = {
            "count": injector.counts[kind],
            "recovery_median": round(statistics.median(waits), 2) if waits else None,
            "recovery_max": round(max(waits), 2) if waits else None,
        }
    return {
        "runs": len(run_ids),
        "tasks": sum(states.values()),
        "task_states": states,
        "executions": executions,
        "rejected_events": rejected,
        "faults": dict(injector.counts),
        "faults_by_kind": by_kind,
        "faults_total": sum(injector.counts.values()),
        "lost": sum(1 for p in problems if "stuck in" in p),
        "lost_detail": [p for p in problems if "stuck in" in p][:10],
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
        f"runs: {r['runs']}  tasks: {r['tasks']}  executions: {r['executions']}"
        + (f"  (and {r['removed']} runs verified, then removed by db clean)" if r.get("removed") else ""),
        f"rejected events (fenced duplicates and late results): {r['rejected_events']}",
        f"task states: {r['task_states']}",
        f"faults injected: {r['faults_total']} of {len(r['faults'])} kinds ({faults})",
        "per kind: count, then seconds from the fault's end to the next task committed (median / max):",
    ]
    for kind, k in r["faults_by_kind"].items():
        median = "-" if k["recovery_median"] is None else f"{k['recovery_median']}s"
        most = "-" if k["recovery_max"] is None else f"{k['recovery_max']}s"
        lines.append(f"  {kind:<18} {k['count']:>5}   {median} / {most}")
    lines += [
        f"waits begun: {r.get('waits', 0)}  events emitted: {r.get('emitted', 0)}  waits and bodies they woke:"
        f" {r.get('woken', 0)}",
        f"processes that exited by themselves and were restarted: {r.get('restarts', 0)}",
    ]
    lines += _format_actions(r.get("actions"))
    named = r.get("named_waits") or {}
    lines += [
        f"runs left waiting on something explain names: {len(named)}"
        + "".join(f"\n  {run}: {what}" for run, what in list(named.items())[:5]),
        f"lost: {r['lost']}  committed twice: {r['committed_twice']}  stuck: {r['stuck']}",
        f"time to recover (last fault's end -> every run final): {r['recovery_seconds']}s  (soak took {r['seconds']}s;"
        f" bound {r.get('settle', SETTLE_SECONDS):g}s)",
    ]
    lines.extend(f"lost: {v}" for v in r.get("lost_detail", []))
    lines.extend(f"violation: {v}" for v in r["other_violations"])
    lines.extend(f"not final, explain says: {e}" for e in r.get("explained", []))
    return lines


def _format_actions(actions: dict[str, dict[str, Any]] | None) -> list[str]:
    """The per action kind table of ``--mix``."""
    if not actions:
        return []
    total = sum(a["count"] for a in actions.values())
    lines = [
        f"operator actions: {total} of {len(actions)} kinds",
        "per action kind: count, applied, refused (not allowed then), errors, violations in the runs it touched:",
    ]
    for kind, a in actions.items():
        targets = ", ".join(f"{t} {n}" for t, n in sorted(a["targets"].items()))
        lines.append(f"  {kind:<18} {a['count']:>5} {a['applied']:>5} {a['refused']:>5} {a['errors']:>5}"
                     f" {a['violations']:>5}   {targets}")  # fmt: skip
        lines.extend(f"      error: {sample}" for sample in a["samples"])
    return lines
