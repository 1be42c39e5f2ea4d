"""The chaos soak's faults: a deck of kinds (kill a pool process or a worker, pause one, restart
or flush Redis, cut the broker's or the database's connections, skew a clock, ...) dealt at
random times by the :class:`Injector`, each followed by its heal."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from ...core.protocol import FencingToken, send_options, sign
from ...engine.facade import Orchestrator
from ...store import make_engine
from .deployment import (  # noqa: F401
    DEFAULT_MODULES,
    LACKED_MODULE,
    LACKING,
    LIBFAKETIME,
    ROOT,
    SKEWED,
    SLEEP_SHIM,
    Deployment,
    PrivatePostgres,
    Relay,
    Relays,
    free_port,
    libfaketime,
    skewed_env,
    stop_group,
)
from .workload import (  # noqa: F401
    RESOURCE,
    RETRY,
    SHAPES,
    WAITING_SHARE,
    D,
    Emit,
    P,
    _branching,
    _mapped,
    _mixed,
    _skipping,
    _waiting,
    emits_for,
    random_dag,
)

#: every kind of fault; ``kill_child`` twice, as before: it is the commonest crash
DECK = ["kill_child", "kill_child", "kill_worker", "pause_worker", "redis_restart", "redis_flush", "broker_cut",
        "pg_terminate", "pg_restart", "pg_partition", "clock_jump", "duplicate_publish"]  # fmt: skip
KINDS = sorted(set(DECK))


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
        #: the kinds this deployment cannot take, and why (reported with the per kind table)
        self.skipped: dict[str, str] = {}
        if dep.pg is None:  # never restart a server the soak does not own
            self.skipped["pg_restart"] = "the database is not the soak's own server (--database-url)"
        if not dep.pg_relays:
            self.skipped["pg_partition"] = "the database is reached over a Unix socket (no relay)"
        if dep.clock_file is None:
            self.skipped["clock_jump"] = "libfaketime is not installed"
        if dep.pool == "threads":  # a threads pool runs its tasks in the worker process itself
            self.skipped["kill_child"] = "a threads pool has no pool processes (kill_worker kills the worker)"
        self.available = set(DECK) - set(self.skipped)

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
