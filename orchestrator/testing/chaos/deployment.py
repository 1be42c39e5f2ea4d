"""The chaos soak's deployment: the real processes it starts and stops — its private PostgreSQL and
Redis servers, TCP relays it can cut, workers (one on a skewed clock under libfaketime), the
reconciler and beat — each in its own process group, stopped by group at the end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

#: the repository (this file is orchestrator/testing/chaos/): where the soak starts its processes
ROOT = Path(__file__).resolve().parents[3]
#: the worker whose clock jumps
SKEWED = "chaos0"
#: the worker (``--mix``) started without one of the task modules (as after a deploy that
#: forgot it): the tasks of that module it receives it does not have
LACKING = "chaos-lacking"
LACKED_MODULE = "tasks.dynamic"
DEFAULT_MODULES = ("tasks.probes", "tasks.etl", "tasks.dynamic", "tasks.canvas")
#: the worker pools the soak can run (``--pool``) and the concurrency of each worker: prefork
#: ``-c 2`` (two pool processes, each a lone hot-path caller), threads ``-c 8`` (eight threads of
#: one process sharing its hot-path connections: enough calls in flight at once for group commit
#: to gather them, on a workload of at most 8 runs of 2-40 short tasks in flight)
POOLS = {"prefork": 2, "threads": 8}
#: ``--reconciler-shards``: the shards' lease (ORCHESTRATOR_RECONCILER_SHARD_LEASE) of every process
#: that runs a reconciler: short, so a killed or paused owner's shards move within a few seconds
SHARD_LEASE = 3.0
LIBFAKETIME = [
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
    Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
    Path("/usr/local/lib/faketime/libfaketimeMT.so.1"),
]


class ChaosConfigError(ValueError):
    """A soak option the soak cannot run with (an unknown pool...): raised before anything starts."""


def check_pool(pool: str, shards: int = 0, reconcilers: int = 1) -> None:
    """Refuse a pool the soak does not run (:data:`POOLS`), a shard count or a number of
    reconcile processes it cannot run with, with :class:`ChaosConfigError`."""
    if pool not in POOLS:
        raise ChaosConfigError(f"unknown pool {pool!r}: the soak runs {' or '.join(sorted(POOLS))} workers")
    if not 0 <= shards <= 4096:
        raise ChaosConfigError(f"reconciler shards {shards}: 0 (one reconciler on duty) to 4096")
    if reconcilers < 0:
        raise ChaosConfigError(f"reconcilers {reconcilers}: 0 or more")


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
    #: the ``orchestrator reconcile`` processes by name (``reconciler``, or ``reconciler0``...)
    reconciler_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: each ``orchestrator reconcile`` process's instance name (``--name``: its name and how many
    #: times it was started, ``reconciler1.3``): the owner ``orc_shards`` names
    instances: dict[str, str] = field(default_factory=dict)
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
    #: the workers' pool, a key of :data:`POOLS` (``--pool``)
    pool: str = "prefork"
    #: ORCHESTRATOR_GROUP_COMMIT=1 for the workers (``--group-commit``)
    group_commit: bool = False
    #: ORCHESTRATOR_RECONCILER_SHARDS of every process that runs a reconciler (``--reconciler-shards``;
    #: 0: one reconciler on duty, the duty lock), with a lease of :data:`SHARD_LEASE`
    shards: int = 0
    #: how many ``orchestrator reconcile`` processes run beside the workers' own (``--reconcilers``)
    reconcilers: int = 1

    def __post_init__(self) -> None:
        check_pool(self.pool, self.shards, self.reconcilers)

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
        if self.shards:  # the workers' reconciler services and the `orchestrator reconcile`s alike
            env.update(ORCHESTRATOR_RECONCILER_SHARDS=str(self.shards),
                       ORCHESTRATOR_RECONCILER_SHARD_LEASE=f"{SHARD_LEASE:g}")  # fmt: skip
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

    def worker_command(self, name: str) -> list[str]:
        """The command line of worker ``name``: its pool (``--pool``) at that pool's concurrency."""
        return [sys.executable, "-m", "celery", "-A", "config.celery_app", "worker", "--pool", self.pool,
                "-c", str(POOLS[self.pool]), "--without-gossip", "--without-mingle", "--loglevel", "INFO",
                "-n", f"{name}@%h"]  # fmt: skip

    def start_worker(self, name: str) -> None:
        cmd = self.worker_command(name)
        broker_port = self.broker_relay.port if self.broker_relay else None
        env = self.env(database_url=self._relayed_url(self.pg_relays.get(name)), broker_port=broker_port)
        # explicit either way: the soak's mode, whatever the deployment's default
        env["ORCHESTRATOR_GROUP_COMMIT"] = "1" if self.group_commit else "0"
        if name == LACKING:
            env["ORCHESTRATOR_TASK_MODULES"] = ",".join(m for m in DEFAULT_MODULES if m != LACKED_MODULE)
        lib = libfaketime()
        if name == SKEWED and self.clock_file is not None and lib is not None:
            env.update(skewed_env(lib, self.clock_file, self.data, env.get("PYTHONPATH", "")))
        self.worker_procs[name] = self._spawn(name, cmd, env)

    @property
    def reconciler_names(self) -> list[str]:
        """The ``orchestrator reconcile`` processes' names: ``reconciler`` alone, as before, or
        ``reconciler0``... with ``--reconcilers`` 2 or more."""
        if self.reconcilers == 1:
            return ["reconciler"]
        return [f"reconciler{i}" for i in range(self.reconcilers)]

    def start_reconciler(self, name: str = "reconciler") -> None:
        """Start (or start again) ``orchestrator reconcile`` ``name``, as a new instance: its
        ``--name`` counts its starts, so a restarted one never renews its dead self's shards."""
        starts = int(self.instances.get(name, f"{name}.0").rpartition(".")[2]) + 1
        self.instances[name] = f"{name}.{starts}"
        cmd = [sys.executable, "-m", "orchestrator.cli", "reconcile", "--interval", "0.3",
               "--name", self.instances[name]]  # fmt: skip
        broker_port = self.broker_relay.port if self.broker_relay else None
        self.reconciler_procs[name] = self._spawn(name, cmd, self.env(broker_port=broker_port))

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
        for name in self.reconciler_names:
            self.start_reconciler(name)

    def supervise(self) -> list[str]:
        """Restart a worker or the reconciler that exited by itself (as a service manager
        would); the names restarted."""
        restarted = []
        for name, proc in list(self.worker_procs.items()):
            if proc.poll() is not None:
                self.start_worker(name)
                restarted.append(name)
        for name, proc in list(self.reconciler_procs.items()):
            if proc.poll() is not None:
                self.start_reconciler(name)
                restarted.append(name)
        return restarted

    def retire(self, name: str) -> None:
        """Stop worker ``name`` for good (warm shutdown: it unregisters, and the tasks it dropped as
        unregistered are released); :meth:`supervise` no longer restarts it."""
        proc = self.worker_procs.pop(name, None)
        if proc is not None:
            stop_group(proc)

    def stop(self) -> None:
        for proc in [*self.worker_procs.values(), *self.reconciler_procs.values(), self.redis]:
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
