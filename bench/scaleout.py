"""Scale-out benchmark: N simulated hosts, each a worker behind a delaying TCP proxy.

Run from the repository root, as root (it makes network namespaces), in the project's venv::

    python bench/scaleout.py [--hosts 1,2,4,8] [--slots 16] [--task-seconds 0.5] [--tasks-per-slot 8]
                             [--rtt-ms 1.0] [--noop-tasks 2000] [--pool-size 4] [--pgbouncer] [--json]

Each simulated host is a network namespace ``orcb<i>`` joined to the root namespace by a veth
pair ``orcv<i>`` / ``orcv<i>p`` (10.77.<i>.1 on the host side, 10.77.<i>.2 inside). A worker in
the namespace (``celery worker --pool threads -c --slots``) reaches Postgres and Redis only
through that host's proxy: a process of its own in the root namespace, listening on 10.77.<i>.1,
that forwards bytes both ways and holds every chunk ``--rtt-ms / 2`` in each direction (one
delay queue per direction, order kept; the kernel here has no ``netem``). The proxy also counts
what crosses it: connections (open, peak) and round trips (a round trip begins each time the
client sends after the server last spoke, so it counts the client's waits whatever the protocol).

For each N of ``--hosts``, two scenarios, each on emptied tables and a flushed Redis database
with N fresh workers (warmed up, then ``--settle-seconds`` idle so the server's statistics of the
warm-up are flushed):

- **sleep**: one fan-out DAG, 1 no-op root -> N x slots x tasks-per-slot ``tasks.probes.sleep``
  (``seconds=--task-seconds``) -> 1 no-op sink; ideal = N x slots / task-seconds tasks/s;
- **noop**: the same shape with ``--noop-tasks`` ``tasks.probes.noop`` in the middle.

Tasks/s counts the middle tasks over submit -> run final, as bench/bench.py's fan-out. Per task
it prints the CPU of all Postgres server processes (``/proc``: the postmaster's reaped children
included), Postgres round trips through the proxies (the workers' only; this process submits and
polls directly), committed + rolled back transactions of the database (``pg_stat_database``, this
process's own subtracted; from the submit until the workers and PgBouncer exited, so every backend
flushed its statistics: their shutdown is included), Redis round trips, the peak of client
sessions on the database (sampled every 50 ms from ``pg_stat_activity``) and each host's peak of
database connections (at its proxy).
``pg_stat_statements`` is used when the server preloads it. The details add the DB-clock span of
the middle tasks, how busy the slots were (sampled every 100 ms; ``--json`` has the series) and
the CPU per task of the workers, Redis, the proxies and PgBouncer.

With ``--pgbouncer``: Debian's PgBouncer (transaction mode, ``--pgbouncer-pool-size`` server
connections) in front of Postgres, the proxies in front of PgBouncer; the duty lock goes straight
to Postgres (through the proxy) as ``ORCHESTRATOR_DB_DIRECT_URL``.

Everything it starts runs in its own process group and is stopped in ``finally`` blocks
(SIGTERM, then SIGKILL); namespaces and veths are deleted likewise, and leftovers of an
interrupted run (names ``orcb<i>`` / ``orcv<i>``) are removed at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import json
import os
import platform
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench import BenchError, _die_with_parent, sigterm_as_exit  # noqa: E402

DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_scaleout"
DEFAULT_REDIS = "redis://127.0.0.1:6379/12"
NOOP = "tasks.probes.noop"
SLEEP = "tasks.probes.sleep"
NS_PREFIX = "orcb"
VETH_PREFIX = "orcv"
#: the ports each host's proxy listens on (on its own 10.77.<i>.1 address)
PG_PORT = 15432
PGB_PORT = 16432
REDIS_PORT = 16379
#: this process's application_name on Postgres (its sessions are told apart from the workers')
BENCH_APP = "orc-scaleout-bench"
#: tables kept between scenarios: the schema's version and the deployment's signing key
KEEP_TABLES = ("alembic_version", "orc_secrets")
#: the target of the issue "Fast at any scale"
TARGET = {"hosts": 4, "slots": 16, "task_seconds": 0.5, "rtt_ms": 1.0, "efficiency": 0.90, "connections": 20}


def log(msg: str) -> None:
    print(f"[scaleout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================ the delaying proxy
# Runs in a process of its own (``--proxy-only``): it must not share a GIL with the measuring
# process. asyncio on a select() selector: epoll's timeout has a 1 ms resolution (Python rounds
# it up), select()'s has 1 us, and the delays here are fractions of a millisecond.


class _Route:
    """One listening address -> one target; the counters of everything that crossed it."""

    def __init__(self, name: str, group: str, target: tuple[str, int], groups: dict[str, list[int]]) -> None:
        self.name = name
        self.group = group
        self.target = target
        self.groups = groups  # group -> [open, peak], shared by the routes of a group
        self.open = 0
        self.peak = 0
        self.total = 0
        self.failed = 0
        self.round_trips = 0
        self.bytes_up = 0
        self.bytes_down = 0

    def opened(self) -> None:
        self.open += 1
        self.total += 1
        self.peak = max(self.peak, self.open)
        g = self.groups.setdefault(self.group, [0, 0])
        g[0] += 1
        g[1] = max(g[1], g[0])

    def closed(self) -> None:
        self.open -= 1
        self.groups[self.group][0] -= 1

    def stats(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "open": self.open,
            "peak": self.peak,
            "total": self.total,
            "failed": self.failed,
            "round_trips": self.round_trips,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
        }


class _Delay:
    """One direction of a proxied connection: each chunk is written ``delay`` seconds after it
    arrived, in order. Each direction has its own queue and timer, so neither waits for the other."""

    #: chunks due within this much of now go out together (timer wake-ups are never exact)
    SLACK = 20e-6

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.dst: asyncio.Transport | None = None
        self.queue: deque[tuple[float, bytes]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.closing = False

    def push(self, data: bytes) -> None:
        if self.delay <= 0.0 and not self.queue:
            self._write(data)
            return
        self.queue.append((self.loop.time() + self.delay, data))
        if self.timer is None:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def close_after(self) -> None:
        """Close the destination once what is queued has been written."""
        self.closing = True
        if not self.queue:
            self._close()

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time() + self.SLACK
        chunks = []
        while self.queue and self.queue[0][0] <= now:
            chunks.append(self.queue.popleft()[1])
        if chunks:
            self._write(b"".join(chunks))
        if self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)
        elif self.closing:
            self._close()

    def _write(self, data: bytes) -> None:
        if self.dst is not None and not self.dst.is_closing():
            self.dst.write(data)

    def _close(self) -> None:
        if self.dst is not None:
            self.dst.close()  # after the transport's own buffer is written


class _Conn:
    def __init__(self, route: _Route, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.route = route
        self.up = _Delay(loop, delay)  # client -> server
        self.down = _Delay(loop, delay)  # server -> client
        self.client: asyncio.Transport | None = None
        self.server: asyncio.Transport | None = None
        self.client_gone = False
        #: the client spoke last (a new round trip starts when it speaks after the server)
        self.client_last = False


class _ServerSide(asyncio.Protocol):
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        c = self.conn
        c.client_last = False
        c.route.bytes_down += len(data)
        c.down.push(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.down.close_after()

    def pause_writing(self) -> None:
        if self.conn.client is not None:
            self.conn.client.pause_reading()

    def resume_writing(self) -> None:
        if self.conn.client is not None and not self.conn.client.is_closing():
            self.conn.client.resume_reading()


#: the proxy's upstream connects in progress
_PENDING: set[asyncio.Task[None]] = set()


class _ClientSide(asyncio.Protocol):
    def __init__(self, route: _Route, delay: float) -> None:
        self.route = route
        self.delay = delay
        self.conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        loop = asyncio.get_running_loop()
        conn = self.conn = _Conn(self.route, loop, self.delay)
        conn.client = transport
        conn.down.dst = transport
        transport.pause_reading()  # until the upstream connection is made
        self.route.opened()
        task = loop.create_task(self._connect(conn))
        _PENDING.add(task)  # the loop keeps only a weak reference to its tasks
        task.add_done_callback(_PENDING.discard)

    async def _connect(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: _ServerSide(conn), *self.route.target)
        except OSError:
            self.route.failed += 1
            if conn.client is not None:
                conn.client.close()
            return
        conn.server = transport
        conn.up.dst = transport
        if conn.client_gone:
            conn.up.close_after()
        elif conn.client is not None:
            conn.client.resume_reading()

    def data_received(self, data: bytes) -> None:
        c = self.conn
        assert c is not None
        if not c.client_last:
            c.client_last = True
            c.route.round_trips += 1
        c.route.bytes_up += len(data)
        c.up.push(data)

    def connection_lost(self, exc: Exception | None) -> None:
        c = self.conn
        assert c is not None
        if not c.client_gone:
            c.client_gone = True
            self.route.closed()
            c.up.close_after()

    def pause_writing(self) -> None:
        if self.conn is not None and self.conn.server is not None:
            self.conn.server.pause_reading()

    def resume_writing(self) -> None:
        if self.conn is not None and self.conn.server is not None and not self.conn.server.is_closing():
            self.conn.server.resume_reading()


PR_SET_TIMERSLACK = 29


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def proxy_main(args: argparse.Namespace) -> int:
    """``--proxy-only``: forward every ``--route NAME:GROUP=LHOST:LPORT=THOST:TPORT`` with
    ``--rtt-ms / 2`` each way; answer ``stats`` / ``reset`` (peaks := open) on ``--control``."""
    delay = args.rtt_ms / 2000.0
    groups: dict[str, list[int]] = {}
    routes: list[tuple[_Route, tuple[str, int]]] = []
    for spec in args.route:
        label, listen, target = spec.split("=")
        name, _, group = label.partition(":")
        routes.append((_Route(name, group or name, _hostport(target), groups), _hostport(listen)))

    # the kernel may wake a sleeping process up to its timer slack (50 us) late: ask for 1 ns
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    asyncio.set_event_loop(loop)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.add_signal_handler(signal.SIGINT, loop.stop)

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        command = (await reader.readline()).decode().strip()
        if command == "reset":
            for route, _ in routes:
                route.peak = route.open
            for g in groups.values():
                g[1] = g[0]
        payload = {
            "routes": {route.name: route.stats() for route, _ in routes},
            "groups": {name: {"open": g[0], "peak": g[1]} for name, g in groups.items()},
        }
        writer.write(json.dumps(payload).encode() + b"\n")
        await writer.drain()
        writer.close()

    async def serve() -> list[asyncio.AbstractServer]:
        servers: list[asyncio.AbstractServer] = []
        for route, (host, port) in routes:
            servers.append(
                await loop.create_server(functools.partial(_ClientSide, route, delay), host, port, reuse_address=True)
            )
        servers.append(await asyncio.start_unix_server(control, path=args.control))
        return servers

    servers = loop.run_until_complete(serve())
    try:
        loop.run_forever()
    finally:
        for server in servers:
            server.close()
        with contextlib.suppress(OSError):
            os.unlink(args.control)
    return 0


# ============================================================================ processes


@dataclass
class Proc:
    """A subprocess of ours in its own session (its pid is its process group id)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def spawn(
        cls,
        name: str,
        cmd: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        die_with_parent: bool = True,
    ) -> Proc:
        with log_path.open("ab") as out:
            popen = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent if die_with_parent else None,
            )  # fmt: skip
        return cls(name, popen, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = ["(no log)"]
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text)

    def terminate(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the group, SIGKILL after ``timeout``; then the group's stragglers."""
        self.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.name} (pid {self.pid}) did not stop within {timeout:g}s: SIGKILL")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def stop_all(procs: list[Proc], timeout: float = 20.0) -> None:
    """Stop in parallel: SIGTERM to every group first, then wait for each."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.stop(max(0.1, deadline - time.monotonic()))


def sh(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# ============================================================================ simulated hosts


@dataclass
class Host:
    index: int
    tmp: Path
    proxy: Proc | None = None
    worker: Proc | None = None

    @property
    def ns(self) -> str:
        return f"{NS_PREFIX}{self.index}"

    @property
    def veth(self) -> str:
        return f"{VETH_PREFIX}{self.index}"

    @property
    def outside(self) -> str:
        """The host side of the veth: where this host's proxy listens."""
        return f"10.77.{self.index}.1"

    @property
    def inside(self) -> str:
        return f"10.77.{self.index}.2"

    @property
    def worker_name(self) -> str:
        return f"{self.ns}@scaleout"

    @property
    def control(self) -> str:
        return str(self.tmp / "proxy.sock")

    def create_network(self) -> None:
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.veth + "p")
        sh("ip", "link", "set", self.veth + "p", "netns", self.ns)
        sh("ip", "addr", "add", f"{self.outside}/30", "dev", self.veth)
        sh("ip", "link", "set", self.veth, "up")
        sh("ip", "-n", self.ns, "addr", "add", f"{self.inside}/30", "dev", self.veth + "p")
        sh("ip", "-n", self.ns, "link", "set", self.veth + "p", "up")
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")

    def start_proxy(self, rtt_ms: float, routes: list[str]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--proxy-only", "--rtt-ms", str(rtt_ms)]
        cmd += ["--control", self.control]
        for r in routes:
            cmd += ["--route", r]
        self.proxy = Proc.spawn(f"proxy{self.index}", cmd, self.tmp / "proxy.log")
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError, ValueError):
                self.query("stats")
                return
            if not self.proxy.alive():
                raise BenchError(f"the proxy of {self.ns} exited\n{self.proxy.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"the proxy of {self.ns} did not answer in 20 s\n{self.proxy.tail()}")
            time.sleep(0.05)

    def query(self, command: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(self.control)
            sock.sendall(command.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        result: dict[str, Any] = json.loads(data)
        return result

    def start_worker(self, env: dict[str, str], slots: int) -> None:
        cmd = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "celery", "-A", "config.celery_app", "worker"]
        cmd += ["--pool", "threads", "-c", str(slots), "--without-gossip", "--without-mingle"]
        cmd += ["--loglevel", "WARNING", "-n", self.worker_name]
        self.worker = Proc.spawn(f"worker{self.index}", cmd, self.tmp / "worker.log", env)


def cleanup_network() -> None:
    """Remove namespaces ``orcb<i>`` and links ``orcv<i>`` / ``orcv<i>p`` left by an earlier run
    (and the processes still running in those namespaces: ours, from that run)."""
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if re.fullmatch(NS_PREFIX + r"\d+", name):
            for pid in sh("ip", "netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
            log(f"removed the leftover namespace {name}")
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if re.fullmatch(VETH_PREFIX + r"\d+p?", name):
                sh("ip", "link", "del", name, check=False)
                log(f"removed the leftover link {name}")


def cleanup_pgbouncers() -> None:
    """Stop a PgBouncer left by an interrupted run of this bench (found by its pid file in one
    of our own /tmp/orc-scaleout-pgbouncer-* directories, checked against its command line)."""
    for pidfile in Path(tempfile.gettempdir()).glob("orc-scaleout-pgbouncer-*/pgbouncer.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if "pgbouncer" in cmdline and str(pidfile.parent) in cmdline:
                os.kill(pid, signal.SIGKILL)
                log(f"stopped the leftover pgbouncer {pid}")


# ============================================================================ PgBouncer


class PgBouncer:
    """Debian's PgBouncer in transaction mode on 127.0.0.1:``port``, in front of Postgres. It
    will not run as root: as root it is started as ``postgres`` in a directory that user owns."""

    def __init__(self, directory: Path, target: Any, port: int, pool_size: int) -> None:
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        self.dir = directory
        self.target = target  # a SQLAlchemy URL
        self.port = port
        self.pool_size = pool_size
        self.proc: Proc | None = None

    def start(self, timeout: float = 20.0) -> None:
        if not os.path.exists(self.binary):
            raise BenchError("--pgbouncer needs pgbouncer (Debian package pgbouncer)")
        self.dir.mkdir(parents=True, exist_ok=True)
        user = self.target.username or "postgres"
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.target.host or '127.0.0.1'} port={self.target.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {self.pool_size}\nmin_pool_size = 0\n"
            "reserve_pool_size = 0\nmax_client_conn = 2000\nserver_reset_query =\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\npidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        cmd = [self.binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            for path in (self.dir, *self.dir.iterdir()):
                shutil.chown(path, "postgres", "postgres")
            cmd[1:1] = ["-u", "postgres"]
        # it changes user, which clears a parent-death signal: stopped by the finally blocks
        self.proc = Proc.spawn("pgbouncer", cmd, self.dir / "stdout.log", die_with_parent=False)
        deadline = time.monotonic() + timeout
        while True:
            if not self.proc.alive():
                raise BenchError(f"pgbouncer exited\n{self.proc.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError(f"pgbouncer did not listen on {self.port} in {timeout:g}s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)
            self.proc = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ============================================================================ measurements

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, int, int, int, int] | None:
    """(comm, ppid, pgrp, utime + stime, cutime + cstime) of a process, CPU in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    close = data.rindex(")")
    comm = data[data.index("(") + 1 : close]
    rest = data[close + 2 :].split()
    # rest[0] is field 3 (state): ppid 4, pgrp 5, utime 14, stime 15, cutime 16, cstime 17
    return comm, int(rest[1]), int(rest[2]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def _all_stats() -> dict[int, tuple[str, int, int, int, int]]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(entry.name)
            if st is not None:
                found[int(entry.name)] = st
    return found


@dataclass
class Cpu:
    """CPU seconds so far of: every Postgres server process (the postmaster's reaped children
    included), PgBouncer, Redis (INFO), the proxies, the workers (each process group)."""

    postgres: float
    pgbouncer: float
    proxies: float
    workers: float
    redis: float

    @classmethod
    def sample(
        cls, hosts: list[Host], pgbouncer: PgBouncer | None, redis_client: Any, postmaster: int | None = None
    ) -> Cpu:
        """With ``postmaster``: that server's processes only (another cluster on the machine,
        started or stopped meanwhile, is not counted); without it every ``postgres`` process."""
        stats = _all_stats()
        pg = 0
        for pid, (comm, ppid, _pgrp, own, children) in stats.items():
            if postmaster is not None:
                if pid == postmaster:
                    pg += own + children  # + its reaped backends
                elif ppid == postmaster:
                    pg += own
            elif comm == "postgres":
                pg += own
                parent = stats.get(ppid)
                if parent is None or parent[0] != "postgres":  # the postmaster: + its reaped backends
                    pg += children

        def group(pgid: int | None) -> int:
            if pgid is None:
                return 0
            return sum(own for (_c, _pp, pgrp, own, _ch) in stats.values() if pgrp == pgid)

        proxies = sum(group(h.proxy.pid if h.proxy else None) for h in hosts)
        workers = sum(group(h.worker.pid if h.worker else None) for h in hosts)
        bouncer = group(pgbouncer.proc.pid if pgbouncer and pgbouncer.proc else None)
        info = redis_client.info("cpu")
        redis_s = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        t = float(CLK_TCK)
        return cls(pg / t, bouncer / t, proxies / t, workers / t, redis_s)

    def minus(self, other: Cpu) -> dict[str, float]:
        return {
            k: getattr(self, k) - getattr(other, k) for k in ("postgres", "pgbouncer", "proxies", "workers", "redis")
        }


class Admin:
    """A session on the ``postgres`` database (so that it is not counted on the bench's)."""

    def __init__(self, url: Any, database: str) -> None:
        import psycopg

        self.database = database
        dsn = url.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True, application_name=BENCH_APP + "-admin")

    def value(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def transactions(self) -> int:
        self.conn.execute("select pg_stat_clear_snapshot()")
        return int(
            self.value("select xact_commit + xact_rollback from pg_stat_database where datname = %s", (self.database,))
        )

    def deadlocks(self) -> int:
        self.conn.execute("select pg_stat_clear_snapshot()")
        return int(self.value("select deadlocks from pg_stat_database where datname = %s", (self.database,)))

    def sessions(self) -> dict[str, int]:
        rows = self.conn.execute(
            "select coalesce(application_name, ''), count(*) from pg_stat_activity"
            " where datname = %s and backend_type = 'client backend' group by 1",
            (self.database,),
        ).fetchall()
        return {str(app): int(n) for app, n in rows}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class SessionPeak:
    """Samples the client sessions open on the database every ``interval`` s in a thread (a
    session of its own, on ``postgres``): the peak of all of them, and without this process's."""

    def __init__(self, admin: Admin, interval: float = 0.05) -> None:
        import psycopg

        self.database = admin.database
        self.conn = psycopg.connect(admin.dsn, autocommit=True, application_name=BENCH_APP + "-sampler")
        self.interval = interval
        self.peak = 0
        self.peak_workers = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scaleout-sessions", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            rows = self.conn.execute(
                "select count(*), count(*) filter (where application_name is distinct from %s)"
                " from pg_stat_activity where datname = %s and backend_type = 'client backend'",
                (BENCH_APP, self.database),
            ).fetchone()
            if rows is not None:
                self.peak = max(self.peak, int(rows[0]))
                self.peak_workers = max(self.peak_workers, int(rows[1]))
                self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> SessionPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()


def statements_available(admin: Admin) -> bool:
    """pg_stat_statements, when the server preloads it (created in the bench database)."""
    preload = str(admin.value("select current_setting('shared_preload_libraries')") or "")
    return "pg_stat_statements" in preload


def measure_rtt(direct_pg: str, proxied_pg: str, redis_direct: Any, redis_proxied: Any, n: int = 200) -> dict[str, Any]:
    """Mean ms of ``n`` ``SELECT 1`` (autocommit) and of ``n`` Redis PINGs, straight and through a proxy."""
    import psycopg

    def pg_ms(dsn: str) -> float:
        with psycopg.connect(dsn, autocommit=True, application_name=BENCH_APP + "-rtt") as conn:
            for _ in range(10):
                conn.execute("select 1").fetchone()
            t0 = time.perf_counter()
            for _ in range(n):
                conn.execute("select 1").fetchone()
            return (time.perf_counter() - t0) / n * 1000.0

    def redis_ms(client: Any) -> float:
        for _ in range(10):
            client.ping()
        t0 = time.perf_counter()
        for _ in range(n):
            client.ping()
        return (time.perf_counter() - t0) / n * 1000.0

    pg_direct, pg_proxied = pg_ms(direct_pg), pg_ms(proxied_pg)
    r_direct, r_proxied = redis_ms(redis_direct), redis_ms(redis_proxied)
    return {
        "round_trips": n,
        "pg_direct_ms": pg_direct,
        "pg_proxied_ms": pg_proxied,
        "pg_added_ms": pg_proxied - pg_direct,
        "redis_direct_ms": r_direct,
        "redis_proxied_ms": r_proxied,
        "redis_added_ms": r_proxied - r_direct,
    }


# ============================================================================ the bench


def running_series(spans: list[tuple[float, float]], step: float) -> list[int]:
    """How many of the (started, finished) spans were running at each ``step`` from the first start."""
    if not spans:
        return []
    t0 = min(a for a, _ in spans)
    t1 = max(b for _, b in spans)
    return [sum(1 for a, b in spans if a <= t < b) for t in (t0 + i * step for i in range(int((t1 - t0) / step) + 1))]


def fanout(name: str, n: int, task: str, kwargs: dict[str, Any] | None = None) -> Any:
    """1 no-op root -> ``n`` ``task`` -> 1 no-op sink."""
    from orchestrator import DAG

    dag = DAG(name)
    root = dag.task("root", NOOP)
    mids = [dag.task(f"m{i:05d}", task, kwargs=kwargs, upstream=[root]) for i in range(n)]
    dag.task("sink", NOOP, upstream=mids)
    return dag


@dataclass
class Scaleout:
    args: argparse.Namespace
    url: Any  # the database's SQLAlchemy URL (straight to Postgres)
    redis_url: Any  # (host, port, db)
    tmp: Path
    hosts: list[Host] = field(default_factory=list)
    pgbouncer: PgBouncer | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    rtt: list[dict[str, Any]] = field(default_factory=list)
    _orc: Any = None
    _admin: Admin | None = None
    _redis: Any = None
    use_statements: bool = False
    #: settings added to every worker's environment (``worker_env``), e.g. by a bench built on this one
    extra_env: dict[str, str] = field(default_factory=dict)

    # -------------------------------------------------------------- clients

    @property
    def database(self) -> str:
        return str(self.url.database)

    @property
    def admin(self) -> Admin:
        if self._admin is None:
            self._admin = Admin(self.url, self.database)
        return self._admin

    @property
    def redis(self) -> Any:
        if self._redis is None:
            import redis

            host, port, db = self.redis_url
            self._redis = redis.Redis(host=host, port=port, db=db, socket_timeout=10)
        return self._redis

    @property
    def orc(self) -> Any:
        if self._orc is None:
            from orchestrator import Orchestrator
            from orchestrator.runtime.celery_app import get_app

            app = get_app()
            app.loader.import_default_modules()
            self._orc = Orchestrator(app=app)
        return self._orc

    def close(self) -> None:
        if self._orc is not None:
            with contextlib.suppress(Exception):
                self._orc.store.dispose()
            with contextlib.suppress(Exception):
                self._orc.app.close()
        if self._admin is not None:
            self._admin.close()

    # -------------------------------------------------------------- database

    def prepare_database(self) -> None:
        """Create the database when it is missing and migrate it (a no-op when at head)."""
        import sqlalchemy as sa

        from orchestrator.store import make_engine, migrate

        name = self.database
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or "scaleout" not in name:
            raise SystemExit(
                f"refusing database {name!r}: the bench empties its tables, so its name must contain"
                " 'scaleout' (letters, digits, '_')"
            )
        admin = sa.create_engine(self.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                exists = conn.execute(sa.text("select 1 from pg_database where datname = :n"), {"n": name}).first()
                if not exists:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
                    log(f"created the database {name}")
        finally:
            admin.dispose()
        engine = make_engine(self.url.render_as_string(hide_password=False))
        try:
            migrate.upgrade(engine)
        finally:
            engine.dispose()
        if statements_available(self.admin):
            try:
                with self.orc.store.engine.begin() as conn:
                    conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                self.use_statements = True
            except sa.exc.DBAPIError as exc:
                log(f"pg_stat_statements is preloaded but not usable here: {exc}")
        log(
            "round trips: the proxies' count; statements: "
            + ("pg_stat_statements" if self.use_statements else "pg_stat_statements not preloaded: transactions only")
        )

    def reset_state(self) -> None:
        """Empty every table but the schema's version and the signing key; flush the Redis database."""
        import sqlalchemy as sa

        with self.orc.store.engine.begin() as conn:
            tables = [
                t
                for (t,) in conn.execute(sa.text("select tablename from pg_tables where schemaname = 'public'"))
                if t not in KEEP_TABLES
            ]
            if tables:
                conn.exec_driver_sql("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " RESTART IDENTITY CASCADE")
        self.redis.flushdb()

    def statements(self) -> int | None:
        if not self.use_statements:
            return None
        value = self.admin.value(
            "select coalesce(sum(calls), 0) from pg_stat_statements s join pg_database d on d.oid = s.dbid"
            " where d.datname = %s",
            (self.database,),
        )
        return int(value)

    # -------------------------------------------------------------- hosts

    def routes(self, host: Host) -> list[str]:
        pg = f"{self.url.host or '127.0.0.1'}:{self.url.port or 5432}"
        r_host, r_port, _ = self.redis_url
        routes = [f"pg:db={host.outside}:{PG_PORT}={pg}", f"redis:redis={host.outside}:{REDIS_PORT}={r_host}:{r_port}"]
        if self.pgbouncer is not None:
            routes.append(f"pgb:db={host.outside}:{PGB_PORT}=127.0.0.1:{self.pgbouncer.port}")
        return routes

    def setup_hosts(self, count: int) -> None:
        import redis

        for i in range(1, count + 1):
            host = Host(i, self.tmp / f"host{i}")
            host.tmp.mkdir(parents=True, exist_ok=True)
            self.hosts.append(host)  # before creating anything: the finally blocks remove it
            host.create_network()
            host.start_proxy(self.args.rtt_ms, self.routes(host))
        log(f"{count} simulated hosts, each behind its proxy ({self.args.rtt_ms:g} ms RTT)")
        direct = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        r_host, r_port, r_db = self.redis_url
        direct_redis = redis.Redis(host=r_host, port=r_port, db=r_db)
        for host in self.hosts:
            proxied = self.url.set(drivername="postgresql", host=host.outside, port=PG_PORT).render_as_string(
                hide_password=False
            )
            proxied_redis = redis.Redis(host=host.outside, port=REDIS_PORT, db=r_db)
            try:
                m = measure_rtt(direct, proxied, direct_redis, proxied_redis)
            finally:
                proxied_redis.close()
            m["host"] = host.ns
            self.rtt.append(m)
            log(
                f"{host.ns}: SELECT 1 {m['pg_direct_ms']:.3f} ms direct, {m['pg_proxied_ms']:.3f} ms through the"
                f" proxy (+{m['pg_added_ms']:.3f}); Redis PING {m['redis_direct_ms']:.3f} -> "
                f"{m['redis_proxied_ms']:.3f} ms (+{m['redis_added_ms']:.3f})"
            )
        direct_redis.close()

    def worker_env(self, host: Host) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
        pg_url = self.url.set(host=host.outside, port=PG_PORT).update_query_dict({"application_name": host.ns})
        _, _, r_db = self.redis_url
        env.update(
            {
                "ORCHESTRATOR_DATABASE_URL": pg_url.render_as_string(hide_password=False),
                "ORCHESTRATOR_BROKER_URL": f"redis://{host.outside}:{REDIS_PORT}/{r_db}",
                "ORCHESTRATOR_DB_POOL_SIZE": str(self.args.pool_size),
                "ORCHESTRATOR_GROUP_COMMIT": "1" if self.args.group_commit else "0",
                "ORCHESTRATOR_CLAIM_DELAY": str(self.args.claim_delay),
                "ORCHESTRATOR_DATA_DIR": str(host.tmp / "data"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.pgbouncer is not None:
            # no application_name of its own: PgBouncer would SET it on the server connection whenever
            # it passes from one host's client to another's (a statement the proxies do not see)
            pooled = self.url.set(host=host.outside, port=PGB_PORT)
            env["ORCHESTRATOR_DATABASE_URL"] = pooled.render_as_string(hide_password=False)
            env["ORCHESTRATOR_DB_TRANSACTION_POOLER"] = "1"
            env["ORCHESTRATOR_DB_DIRECT_URL"] = pg_url.render_as_string(hide_password=False)
        env.update(self.extra_env)
        return env

    def start_workers(self, hosts: list[Host]) -> None:
        import sqlalchemy as sa

        for host in hosts:
            host.start_worker(self.worker_env(host), self.args.slots)
        want = {h.worker_name for h in hosts}
        deadline = time.monotonic() + self.args.start_timeout
        while True:
            self.check_workers(hosts)
            with self.orc.store.engine.connect() as conn:
                names = set(conn.execute(sa.text("select name from orc_workers")).scalars())
            if want <= names:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"workers {sorted(want - names)} not ready in {self.args.start_timeout:g}s")
            time.sleep(0.1)

    def check_workers(self, hosts: list[Host]) -> None:
        for h in hosts:
            if h.worker is not None and not h.worker.alive():
                raise BenchError(f"worker {h.worker_name} exited ({h.worker.popen.returncode})\n{h.worker.tail()}")

    def stop_workers(self) -> None:
        workers = [h.worker for h in self.hosts if h.worker is not None]
        stop_all(workers, 20.0)
        for h in self.hosts:
            h.worker = None

    def proxy_stats(self, hosts: list[Host], command: str = "stats") -> list[dict[str, Any]]:
        return [h.query(command) for h in hosts]

    # -------------------------------------------------------------- runs

    def run(self, dag: Any, hosts: list[Host], timeout: float) -> tuple[Any, float]:
        """Submit ``dag``, wait for its run (checking the workers), return (run, seconds)."""
        from orchestrator import RunTimeout

        t0 = time.perf_counter()
        run = self.orc.submit(dag)
        deadline = time.monotonic() + timeout
        while True:
            try:
                view = run.wait(min(2.0, max(0.05, deadline - time.monotonic())), poll=self.args.poll)
                break
            except RunTimeout:
                self.check_workers(hosts)
                if time.monotonic() >= deadline:
                    raise BenchError(f"run {run.id} of {dag.name} not final after {timeout:g}s") from None
        elapsed = time.perf_counter() - t0
        if view.state.value != "SUCCEEDED":
            raise BenchError(f"run {run.id} of {dag.name} ended {view.state.value}: {view.counts}")
        return run, elapsed

    def db_figures(self, run_id: str) -> dict[str, Any]:
        import sqlalchemy as sa

        with self.orc.store.engine.connect() as conn:
            ok, span, first, last_start = conn.execute(
                sa.text(
                    "select count(*) filter (where state = 'SUCCEEDED'),"
                    " extract(epoch from max(finished_at) - min(started_at)),"
                    " (select extract(epoch from min(m.started_at) - r.created_at) from orc_runs r where r.id = :r),"
                    " extract(epoch from max(started_at) - min(started_at))"
                    " from orc_tasks m where run_id = :r and key like 'm%'"
                ),
                {"r": run_id},
            ).one()
            run_span = conn.execute(
                sa.text("select extract(epoch from finished_at - created_at) from orc_runs where id = :r"),
                {"r": run_id},
            ).scalar_one()
            spans = conn.execute(
                sa.text(
                    "select extract(epoch from started_at), extract(epoch from finished_at) from orc_tasks"
                    " where run_id = :r and key like 'm%' and started_at is not null and finished_at is not null"
                ),
                {"r": run_id},
            ).all()
        return {
            "succeeded": int(ok),
            "middle_span_s": float(span or 0.0),
            "first_middle_started_after_submit_s": float(first or 0.0),
            "middle_starts_spread_s": float(last_start or 0.0),
            "db_run_span_s": float(run_span or 0.0),
            "running_every_100ms": running_series([(float(a), float(b)) for a, b in spans], 0.1),
        }

    def wait_no_sessions(self, timeout: float = 15.0) -> int:
        """Until no client session is left on the database (each exiting backend flushes its
        statistics); returns how many were still open at the end."""
        deadline = time.monotonic() + timeout
        while True:
            left = sum(self.admin.sessions().values())
            if left == 0 or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def scenario(self, n: int, kind: str) -> dict[str, Any]:
        import sqlalchemy as sa

        args = self.args
        hosts = self.hosts[:n]
        slots = n * args.slots
        if kind == "sleep":
            tasks = slots * args.tasks_per_slot
            task, kwargs = SLEEP, {"seconds": args.task_seconds}
            ideal: float | None = slots / args.task_seconds
        else:
            tasks = args.noop_tasks
            task, kwargs, ideal = NOOP, None, None
        row: dict[str, Any] = {"hosts": n, "scenario": kind, "tasks": tasks, "slots": slots, "ideal_tasks_per_s": ideal}
        log(f"--- {n} host(s) x {args.slots} slots: {kind}, {tasks} tasks")
        self.reset_state()
        try:
            if self.pgbouncer is not None:
                self.pgbouncer.start()
            t_start = time.perf_counter()
            self.start_workers(hosts)
            log(f"{n} worker(s) ready in {time.perf_counter() - t_start:.1f}s")
            # warm-up: every thread claims something, the pools open their connections
            warm_task, warm_kwargs = (SLEEP, {"seconds": 0.05}) if kind == "sleep" else (NOOP, None)
            self.run(fanout(f"warmup_{kind}_{n}", 2 * slots, warm_task, warm_kwargs), hosts, args.timeout)
            # this process's sessions end (their statistics flushed); the workers' idle sessions flush theirs
            # after 10 s idle (PostgreSQL >= 15), their busy ones at most 1 s after their last transaction
            self.orc.store.dispose()
            time.sleep(args.settle_seconds)
            self.check_workers(hosts)

            engine = self.orc.store.engine
            own = [0]

            def count(*_: Any) -> None:
                own[0] += 1

            tx_before = self.admin.transactions()
            deadlocks_before = self.admin.deadlocks()
            st_before = self.statements()
            before_proxy = self.proxy_stats(hosts, "reset")
            cpu_before = Cpu.sample(hosts, self.pgbouncer, self.redis)
            sa.event.listen(engine, "begin", count)
            sa.event.listen(engine.pool, "checkout", count)
            try:
                with SessionPeak(self.admin) as peak:
                    run, elapsed = self.run(
                        fanout(f"{kind}_{n}x{args.slots}", tasks, task, kwargs), hosts, args.timeout
                    )
                    cpu_after = Cpu.sample(hosts, self.pgbouncer, self.redis)
                    after_proxy = self.proxy_stats(hosts)
            finally:
                sa.event.remove(engine, "begin", count)
                sa.event.remove(engine.pool, "checkout", count)
            own_tx = own[0]
        finally:
            self.stop_workers()
            if self.pgbouncer is not None:
                self.pgbouncer.stop()
        self.orc.store.dispose()
        left = self.wait_no_sessions()
        tx_after = self.admin.transactions()
        deadlocks = self.admin.deadlocks() - deadlocks_before
        st_after = self.statements()
        figures = self.db_figures(run.id)
        if figures["succeeded"] != tasks:
            raise BenchError(f"run {run.id}: {figures['succeeded']} of {tasks} middle tasks succeeded")

        def delta(route: str, key: str) -> int:
            total = 0
            for b, a in zip(before_proxy, after_proxy, strict=True):
                if route in a["routes"]:
                    total += a["routes"][route][key] - b["routes"][route][key]
            return total

        db_routes = ("pg", "pgb")
        pg_rt = sum(delta(r, "round_trips") for r in db_routes)
        redis_rt = delta("redis", "round_trips")
        cpu = cpu_after.minus(cpu_before)
        per_host_db = [p["groups"].get("db", {}).get("peak", 0) for p in after_proxy]
        per_host_redis = [p["groups"].get("redis", {}).get("peak", 0) for p in after_proxy]
        tps = tasks / elapsed
        row.update(
            {
                "run_id": run.id,
                "wall_s": elapsed,
                "tasks_per_s": tps,
                "efficiency": tps / ideal if ideal else None,
                "middle_efficiency": (tasks / figures["middle_span_s"]) / ideal
                if ideal and figures["middle_span_s"] > 0
                else None,
                "pg_cpu_ms_per_task": cpu["postgres"] * 1000.0 / tasks,
                "pg_round_trips_per_task": pg_rt / tasks,
                "pg_round_trips": pg_rt,
                "statements_per_task": (st_after - st_before) / tasks
                if st_after is not None and st_before is not None
                else None,
                "transactions_per_task": (tx_after - tx_before - own_tx) / tasks,
                "transactions": tx_after - tx_before,
                "bench_own_transactions": own_tx,
                "deadlocks": deadlocks,
                "sessions_left_before_reading_transactions": left,
                "redis_round_trips_per_task": redis_rt / tasks,
                "server_sessions_peak": peak.peak,
                "server_sessions_peak_without_bench": peak.peak_workers,
                "session_samples": peak.samples,
                "db_connections_per_host": per_host_db,
                "redis_connections_per_host": per_host_redis,
                "cpu_ms_per_task": {k: v * 1000.0 / tasks for k, v in cpu.items()},
                "cpu_s": cpu,
                "cpu_utilisation": {k: v / elapsed for k, v in cpu.items()},
                **figures,
            }
        )
        if ideal:  # slots busy, sampled every 100 ms from the first start to the last finish (DB clock)
            series = [x / slots for x in figures["running_every_100ms"]]
            row["slots_busy_mean"] = sum(series) / len(series) if series else None
            row["slots_busy_below_90pct_samples"] = sum(1 for x in series if x < 0.9)
            row["slots_busy_samples"] = len(series)
        eff = f", {row['efficiency'] * 100:.1f} % of ideal" if ideal else ""
        log(
            f"{n} host(s) {kind}: {tasks} tasks in {elapsed:.2f}s = {tps:.1f} tasks/s{eff};"
            f" {row['pg_round_trips_per_task']:.2f} pg round trips/task, server sessions peak {peak.peak}"
        )
        return row


# ============================================================================ report


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(bench: Scaleout, meta: dict[str, Any]) -> str:
    args = bench.args
    lines = [
        f"Scale-out bench: {args.slots} thread slots per host, sleep {args.task_seconds:g}s x {args.tasks_per_slot}"
        f" per slot, {args.noop_tasks} no-ops; {args.rtt_ms:g} ms RTT; ORCHESTRATOR_DB_POOL_SIZE={args.pool_size};"
        + (" ORCHESTRATOR_GROUP_COMMIT=1;" if args.group_commit else "")
        + (f" ORCHESTRATOR_CLAIM_DELAY={args.claim_delay:g};" if args.claim_delay else "")
        + (f" PgBouncer transaction mode, {args.pgbouncer_pool_size} server connections" if args.pgbouncer else "")
        + f" ({meta['cpus']} CPUs, Python {meta['python']})",
        "",
    ]
    if bench.rtt:
        added_pg = [m["pg_added_ms"] for m in bench.rtt]
        added_r = [m["redis_added_ms"] for m in bench.rtt]
        lines.append(
            f"proxy RTT added (200 round trips each): Postgres SELECT 1 +{min(added_pg):.3f}..{max(added_pg):.3f} ms"
            f" (direct {bench.rtt[0]['pg_direct_ms']:.3f} ms), Redis PING +{min(added_r):.3f}..{max(added_r):.3f} ms"
            f" (direct {bench.rtt[0]['redis_direct_ms']:.3f} ms)"
        )
        lines.append("")
    header = (
        f"{'hosts':>5} {'scenario':<8} {'tasks':>6} {'wall s':>7} {'tasks/s':>8} {'ideal/s':>8} {'eff %':>6}"
        f" {'pgCPU ms/t':>10} {'pg RT/t':>7} {'xact/t':>6} {'redis RT/t':>10} {'srv conns':>9}  db conns per host"
    )
    lines += [header, "-" * len(header)]
    for r in bench.rows:
        if "error" in r:
            lines.append(f"{r['hosts']:>5} {r['scenario']:<8} {r['tasks']:>6}  FAILED: {r['error'].splitlines()[0]}")
            continue
        eff = r["efficiency"] * 100 if r["efficiency"] is not None else None
        lines.append(
            f"{r['hosts']:>5} {r['scenario']:<8} {r['tasks']:>6} {r['wall_s']:>7.2f} {r['tasks_per_s']:>8.1f}"
            f" {fmt(r['ideal_tasks_per_s'], '.1f'):>8} {fmt(eff, '.1f'):>6} {r['pg_cpu_ms_per_task']:>10.2f}"
            f" {r['pg_round_trips_per_task']:>7.2f} {r['transactions_per_task']:>6.2f}"
            f" {r['redis_round_trips_per_task']:>10.2f} {r['server_sessions_peak']:>9}"
            f"  {'/'.join(str(c) for c in r['db_connections_per_host'])}"
        )
    lines += [
        "",
        "tasks/s: middle tasks over submit -> run final (root and sink no-ops included in the time);"
        " ideal = hosts x slots / task seconds.",
        "pgCPU: all Postgres server processes (/proc, reaped backends included), submit -> final, per middle task;"
        " pg RT: round trips through the hosts' proxies (workers only; this process submits and polls directly).",
        "xact: pg_stat_database commits + rollbacks, this process's own subtracted"
        + ("" if bench.use_statements else " (pg_stat_statements is not preloaded: no statement count)")
        + "; srv conns: peak client sessions on the database (this process's included); db conns per host:"
        " peak at each host's proxy.",
        "",
        "details:",
    ]
    for r in bench.rows:
        if "error" in r:
            continue
        cpu = r["cpu_ms_per_task"]
        util = r["cpu_utilisation"]
        mid = r["middle_efficiency"]
        lines.append(
            f"  {r['hosts']} host(s) {r['scenario']}: DB span of the middle tasks {r['middle_span_s']:.2f}s"
            + (f" ({mid * 100:.1f} % of ideal)" if mid is not None else "")
            + f", first started {r['first_middle_started_after_submit_s'] * 1000:.0f} ms after the run was created;"
            + (
                f" slots busy (100 ms samples) mean {r['slots_busy_mean'] * 100:.1f} %,"
                f" {r['slots_busy_below_90pct_samples']} of {r['slots_busy_samples']} samples below 90 %;"
                if r.get("slots_busy_mean") is not None
                else ""
            )
            + f" CPU ms/task: postgres {cpu['postgres']:.2f}, workers {cpu['workers']:.2f}, redis {cpu['redis']:.2f},"
            f" proxies {cpu['proxies']:.2f}"
            + (f", pgbouncer {cpu['pgbouncer']:.2f}" if bench.pgbouncer is not None else "")
            + f" (cores busy: postgres {util['postgres']:.2f}, workers {util['workers']:.2f});"
            + f" deadlocks {r['deadlocks']};"
            f" server sessions peak without this process {r['server_sessions_peak_without_bench']};"
            f" redis conns per host {'/'.join(str(c) for c in r['redis_connections_per_host'])}"
            + (f"; statements/task {r['statements_per_task']:.2f}" if r.get("statements_per_task") is not None else "")
        )
    target = [
        r
        for r in bench.rows
        if "error" not in r
        and r["scenario"] == "sleep"
        and r["hosts"] == TARGET["hosts"]
        and args.slots == TARGET["slots"]
        and args.task_seconds == TARGET["task_seconds"]
        and args.rtt_ms == TARGET["rtt_ms"]
    ]
    lines.append("")
    if target:
        r = target[0]
        eff_ok = r["efficiency"] >= TARGET["efficiency"]
        conn_ok = r["server_sessions_peak"] <= TARGET["connections"]
        lines.append(
            f"target (4 hosts x 16 slots of sleep(0.5) through 1 ms RTT): >= 90 % of ideal:"
            f" {r['efficiency'] * 100:.1f} % {'yes' if eff_ok else 'NO'}; <= 20 server connections:"
            f" {r['server_sessions_peak']} {'yes' if conn_ok else 'NO'}"
            f" ({r['server_sessions_peak_without_bench']} without this process's)"
        )
    else:
        lines.append("target (4 hosts x 16 slots of sleep(0.5) through 1 ms RTT): not measured by this configuration")
    return "\n".join(lines)


# ============================================================================ main


def parse_hosts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: comma-separated integers") from None
    if not values or any(v < 1 or v > 64 for v in values):
        raise argparse.ArgumentTypeError("--hosts: between 1 and 64 hosts each")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--hosts", type=parse_hosts, default=[1, 2, 4, 8], help="host counts to run (default 1,2,4,8)")
    p.add_argument("--slots", type=int, default=16, help="thread slots per worker (-c; default 16)")
    p.add_argument("--task-seconds", type=float, default=0.5, help="seconds each sleep task sleeps (default 0.5)")
    p.add_argument("--tasks-per-slot", type=int, default=8, help="sleep tasks per slot (default 8)")
    p.add_argument("--rtt-ms", type=float, default=1.0, help="RTT the proxies add (default 1.0)")
    p.add_argument("--noop-tasks", type=int, default=2000, help="no-op tasks of the no-op scenario (default 2000)")
    p.add_argument("--pool-size", type=int, default=4, help="ORCHESTRATOR_DB_POOL_SIZE of each worker (default 4)")
    p.add_argument("--pgbouncer", action="store_true", help="run through PgBouncer in transaction mode")
    p.add_argument("--group-commit", action="store_true", help="ORCHESTRATOR_GROUP_COMMIT=1 on the workers")
    p.add_argument("--claim-delay", type=float, default=0.0, help="ORCHESTRATOR_CLAIM_DELAY of the workers (default 0)")
    p.add_argument("--pgbouncer-pool-size", type=int, default=8, help="PgBouncer's default_pool_size (default 8)")
    p.add_argument("--database-url", default=DEFAULT_DB, help=f"name must contain 'scaleout' (default {DEFAULT_DB})")
    p.add_argument("--redis-url", default=DEFAULT_REDIS, help=f"flushed before each scenario (default {DEFAULT_REDIS})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take (default 300)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds the workers may take to start")
    p.add_argument(
        "--settle-seconds", type=float, default=11.0, help="idle seconds after the warm-up (statistics flush; 11)"
    )
    p.add_argument("--poll", type=float, default=0.02, help="seconds between this process's run-state polls")
    p.add_argument("--scenarios", default="sleep,noop", help="which scenarios (default sleep,noop)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    # internal: the proxy process
    p.add_argument("--proxy-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--route", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.proxy_only:
        return args
    if args.slots < 1 or args.tasks_per_slot < 1 or args.task_seconds <= 0 or args.noop_tasks < 1:
        p.error("--slots, --tasks-per-slot, --task-seconds and --noop-tasks must be positive")
    if args.pool_size < 1 or args.pgbouncer_pool_size < 1 or args.rtt_ms < 0:
        p.error("--pool-size and --pgbouncer-pool-size must be at least 1, --rtt-ms at least 0")
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not args.scenarios or any(s not in ("sleep", "noop") for s in args.scenarios):
        p.error("--scenarios: sleep and/or noop")
    if not args.redis_url.startswith("redis://"):
        p.error("--redis-url must be redis://host:port/db")
    return args


def configure_process(url: Any, redis_url: str, tmp: Path, pool_size: int) -> None:
    """This process submits and polls straight to Postgres and Redis (as ``BENCH_APP``): its
    settings, in the environment before the app is first built."""
    bench_url = url.update_query_dict({"application_name": BENCH_APP})
    os.environ.update(
        {
            "ORCHESTRATOR_DATABASE_URL": bench_url.render_as_string(hide_password=False),
            "ORCHESTRATOR_BROKER_URL": redis_url,
            "ORCHESTRATOR_DATA_DIR": str(tmp / "bench-data"),
            "ORCHESTRATOR_DB_POOL_SIZE": str(pool_size),
        }
    )
    for key in ("ORCHESTRATOR_DB_TRANSACTION_POOLER", "ORCHESTRATOR_DB_DIRECT_URL", "ORCHESTRATOR_TENANT"):
        os.environ.pop(key, None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.proxy_only:
        return proxy_main(args)
    if os.geteuid() != 0:
        raise SystemExit("the scale-out bench makes network namespaces: run it as root")

    import urllib.parse

    import sqlalchemy as sa

    url = sa.engine.make_url(args.database_url)
    if not url.drivername.startswith("postgresql"):
        raise SystemExit("--database-url must be PostgreSQL")
    parsed = urllib.parse.urlsplit(args.redis_url)
    if parsed.password or parsed.username:
        raise SystemExit("--redis-url: a Redis without credentials (redis://host:port/db)")
    redis_url = (parsed.hostname or "127.0.0.1", parsed.port or 6379, int(parsed.path.strip("/") or 0))

    tmp = Path(tempfile.mkdtemp(prefix="orc-scaleout-"))
    configure_process(url, args.redis_url, tmp, args.pool_size)
    from orchestrator.core.errors import OrchestratorError  # after the settings are in the environment

    bench = Scaleout(args, url, redis_url, tmp)
    meta: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "database": args.database_url,
        "broker": args.redis_url,
        "hosts": args.hosts,
        "slots": args.slots,
        "task_seconds": args.task_seconds,
        "tasks_per_slot": args.tasks_per_slot,
        "rtt_ms": args.rtt_ms,
        "pool_size": args.pool_size,
        "pgbouncer": args.pgbouncer,
        "group_commit": args.group_commit,
        "claim_delay": args.claim_delay,
        "pgbouncer_pool_size": args.pgbouncer_pool_size if args.pgbouncer else None,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    started = time.perf_counter()
    ok = False
    with sigterm_as_exit():
        try:
            cleanup_pgbouncers()
            cleanup_network()
            bench.prepare_database()
            if args.pgbouncer:
                # a directory of its own: PgBouncer runs as postgres, which cannot enter ``tmp``
                pgb_dir = Path(tempfile.mkdtemp(prefix="orc-scaleout-pgbouncer-"))
                bench.pgbouncer = PgBouncer(pgb_dir, url, free_port(), args.pgbouncer_pool_size)
            bench.setup_hosts(max(args.hosts))
            for n in args.hosts:
                for kind in args.scenarios:
                    try:
                        bench.rows.append(bench.scenario(n, kind))
                    except (BenchError, OrchestratorError, sa.exc.SQLAlchemyError, OSError) as exc:
                        log(f"FAILED: {n} host(s) {kind}: {type(exc).__name__}: {exc}")
                        for h in bench.hosts[:n]:
                            if h.worker is not None:
                                log(h.worker.tail())
                        bench.rows.append({"hosts": n, "scenario": kind, "tasks": 0, "error": str(exc)})
            ok = all("error" not in r for r in bench.rows)
        except KeyboardInterrupt:
            log("interrupted")
        except BenchError as exc:
            log(f"FAILED: {exc}")
        finally:
            workers = [h.worker for h in bench.hosts if h.worker is not None]
            stop_all(workers, 20.0)
            if bench.pgbouncer is not None:
                bench.pgbouncer.stop()
                shutil.rmtree(bench.pgbouncer.dir, ignore_errors=True)
            stop_all([h.proxy for h in bench.hosts if h.proxy is not None], 5.0)
            for h in bench.hosts:
                sh("ip", "netns", "del", h.ns, check=False)
                sh("ip", "link", "del", h.veth, check=False)
            with contextlib.suppress(Exception):
                bench.redis.flushdb()
            bench.close()
    meta["total_s"] = round(time.perf_counter() - started, 1)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if bench.rows:
        print(report(bench, meta))
        print(f"\n(total bench time {meta['total_s']}s)")
    if args.json:
        print(json.dumps({"meta": meta, "rtt": bench.rtt, "rows": bench.rows, "complete": ok}, default=str))
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"kept {tmp} (worker and proxy logs) for inspection")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
