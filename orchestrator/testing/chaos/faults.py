"""The chaos soak's faults: a deck of kinds (kill a pool process or a worker, pause one, restart
or flush Redis, cut the broker's or the database's connections, skew a clock, ...) dealt at
random times by the :class:`Injector`, each followed by its heal."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    SHARD_LEASE,
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
#: the kinds dealt only with the sharded control plane on (``--reconciler-shards``), added to the
#: deck then: an ``orchestrator reconcile`` instance killed -9 while it owns shards (and started
#: again), or paused past the shards' lease and resumed (its shards claimed by another meanwhile:
#: two instances that both believe they own them, until its next turn on the shard table)
SHARDED_DECK = ["kill_reconciler", "pause_reconciler"]
SHARDED_KINDS = sorted(SHARDED_DECK)
_RENEWED = sa.text("SELECT max(renewed_at) FROM orc_shards WHERE owner = :owner")
_OWNED = sa.text("SELECT owner, count(*) AS n FROM orc_shards WHERE owner IS NOT NULL GROUP BY owner")


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
        #: the kinds of this deployment's deck: the sharded ones too with the shards on
        self.kinds = DECK + (SHARDED_DECK if dep.shards else [])
        if dep.shards and not dep.reconcilers:
            for kind in SHARDED_DECK:
                self.skipped[kind] = "no `orchestrator reconcile` process (--reconcilers 0)"
        self.available = set(self.kinds) - set(self.skipped)
        #: the reconcile processes paused now (pids), and the shards each kill_reconciler found its
        #: victim holding (an instance just started may hold none yet)
        self.paused: set[int] = set()
        self.held_at_kill: list[int] = []

    @property
    def db_down(self) -> bool:
        return self.dep.pg is not None and not self.dep.pg.running

    def lasting(self) -> set[str]:
        return {h.kind for h in self.heals}

    def _draw(self) -> str | None:
        blocked = self.lasting()
        if self.db_down or "pg_restart" in blocked:  # (the shards' owners are read from the database)
            blocked |= {"pg_terminate", "duplicate_publish", *SHARDED_DECK}
        if "pause_worker" in blocked or "pg_partition" in blocked:
            blocked |= {"pause_worker", "pg_partition"}  # one worker out at a time, not all
        if not self.deck:
            self.deck = [k for k in self.kinds if k in self.available]
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

    def _paused(self, proc: subprocess.Popen[bytes], seconds: float) -> tuple[float, Callable[[], None]]:
        """A process paused for ``seconds``: resumed by a timer thread of its own as well as by the
        heal, so that the soak's loop, blocked on a lock the paused process holds (a transaction
        it was in, waited on by a submit), never keeps it paused."""
        self.paused.add(proc.pid)

        def resume() -> None:
            self.paused.discard(proc.pid)
            if proc.poll() is None:  # not killed (and reaped) meanwhile
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)

        _later(seconds, resume)
        return seconds, resume

    def pause_worker(self) -> tuple[float, Callable[[], None]]:
        _, proc = self._worker()
        os.killpg(proc.pid, signal.SIGSTOP)
        return self._paused(proc, 2.5 + self.rng.random())  # past the 2 s lease

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
        # healed by a timer as well (see _paused): a transaction cut off may hold what the loop waits on
        seconds = 3.0 + 2.0 * self.rng.random()
        _later(seconds, lambda: relays.blackhole(relay, False))
        return seconds, lambda: relays.blackhole(relay, False)

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

    # -- the sharded control plane's (``--reconciler-shards``): an ``orchestrator reconcile`` instance

    def _owner(self) -> tuple[str, subprocess.Popen[bytes], int]:
        """A reconcile process that owns shards now (not paused), and how many; any one not paused
        when none does (all just started), with 0."""
        with self.orc.store.engine.connect() as conn:
            owned = {str(r.owner): int(r.n) for r in conn.execute(_OWNED)}
        procs = self.dep.reconciler_procs
        live = [n for n in sorted(procs) if procs[n].pid not in self.paused and procs[n].poll() is None]
        owners = [n for n in live if owned.get(self.dep.instances[n], 0) > 0]
        name = self.rng.choice(owners or live or sorted(procs))
        return name, procs[name], owned.get(self.dep.instances[name], 0)

    def kill_reconciler(self) -> None:
        """kill -9 a reconcile instance that owns shards, and start another in its place (a new
        instance: the dead one's shards are claimed once their lease has run out)."""
        name, proc, held = self._owner()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.paused.discard(proc.pid)
        self.held_at_kill.append(held)
        self.dep.start_reconciler(name)

    def _after_turn(self, owner: str, most: float = 1.0) -> None:
        """Until ``owner`` renews its shards (its turn on the shard table, just before its pass),
        for ``most`` seconds at most: paused then, it is in a pass with the fence it just read."""
        with self.orc.store.engine.connect() as conn:
            before = conn.execute(_RENEWED, {"owner": owner}).scalar()
            deadline = time.monotonic() + most
            while time.monotonic() < deadline:
                time.sleep(0.01)
                conn.rollback()  # a new snapshot: now() moves
                if conn.execute(_RENEWED, {"owner": owner}).scalar() != before:
                    return

    def pause_reconciler(self) -> tuple[float, Callable[[], None]]:
        """SIGSTOP a reconcile instance that owns shards, just after its turn on the shard table
        (in the pass that follows), for longer than the shards' lease: the others claim its
        shards (at new epochs) while it still believes it holds them; resumed, the writes of the
        pass it was in are refused (a stale epoch), then its next turn finds the shards gone."""
        name, proc, _ = self._owner()
        self._after_turn(self.dep.instances[name])
        os.killpg(proc.pid, signal.SIGSTOP)
        return self._paused(proc, SHARD_LEASE + 0.5 + self.rng.random())


def _later(seconds: float, action: Callable[[], None]) -> None:
    """``action`` in ``seconds`` on a daemon timer thread (an error ignored: the heal retries)."""

    def run() -> None:
        with contextlib.suppress(Exception):
            action()

    timer = threading.Timer(seconds, run)
    timer.daemon = True
    timer.start()


#: the ledger's stale-epoch refusals (a deposed owner's write, refused and recorded) per write
_STALE = sa.text(
    "SELECT to_state, count(*) AS n FROM orc_task_events"
    " WHERE NOT accepted AND starts_with(reason, 'stale shard epoch') GROUP BY to_state ORDER BY to_state"
)
_CLAIMS = sa.text("SELECT coalesce(sum(epoch), 0) AS claims, count(*) AS k FROM orc_shards")


def shard_summary(orc: Orchestrator, injector: Injector) -> dict[str, Any]:
    """The sharded control plane's figures for the report (``--reconciler-shards``): the shard
    claims (each one moved an epoch), the stale-epoch refusals by the write refused (``RUN`` for
    a run's own), and how many shards each killed reconcile instance held when it died."""
    for _ in range(5):
        try:
            with orc.store.engine.connect() as conn:
                stale = {str(r.to_state or "RUN"): int(r.n) for r in conn.execute(_STALE)}
                claims = conn.execute(_CLAIMS).one()
            break
        except sa.exc.DBAPIError:
            time.sleep(0.5)
    else:
        return {"error": "could not read the shards"}
    held = injector.held_at_kill
    return {
        "shards": int(claims.k), "lease": SHARD_LEASE, "reconcilers": len(injector.dep.reconciler_procs),
        "claims": int(claims.claims), "stale_refusals": sum(stale.values()), "stale_by_write": stale,
        "killed_owning": sum(1 for n in held if n > 0), "killed": len(held), "killed_shards": sum(held),
    }  # fmt: skip


def format_shards(s: dict[str, Any] | None) -> list[str]:
    """The report's lines on the sharded control plane (none when it was off)."""
    if not s:
        return []
    if "error" in s:
        return [f"sharded control plane: {s['error']}"]
    by = ", ".join(f"{k} {v}" for k, v in s["stale_by_write"].items())
    return [
        f"sharded control plane: {s['shards']} shards, lease {s['lease']:g}s, {s['reconcilers']} reconcile"
        f" processes beside the workers' services; shard claims (epochs moved): {s['claims']}",
        f"stale-epoch refusals (a deposed owner's writes, refused and recorded): {s['stale_refusals']}"
        + (f" ({by})" if by else ""),
        f"reconcile instances killed -9: {s['killed']}, {s['killed_owning']} of them owning shards"
        f" ({s['killed_shards']} shards in all)",
    ]
