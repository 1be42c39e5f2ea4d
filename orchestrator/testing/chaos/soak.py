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
clean`` (:mod:`orchestrator.testing.chaos.mix`); their DAGs grow approvals and a resource, their maps are
inserted 8 children at a time, and a third worker runs without ``tasks.dynamic``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ...core.dag import DAG
from ...core.dag import bounds as dag_bounds
from ...engine.facade import Orchestrator
from ...store import Store, make_engine, migrate
from .deployment import (
    LACKING,
    POOLS,
    Deployment,
    PrivatePostgres,
    check_pool,
)
from .faults import Injector, format_shards, shard_summary
from .mix import Mixer, run_states
from .workload import (
    RESOURCE,
    Emit,
    emits_for,
    random_dag,
)

#: ``--mix``: maps insert their children this many at a time (``dag.MAP_WINDOW``), so the soak's
#: maps of 20 and 30 items are wider than one insert window
MIX_MAP_WINDOW = 8


#: after the last fault and the last action, every run final within this many seconds (or
#: waiting on something ``explain`` names); past it the rest counts as stuck
SETTLE_SECONDS = 180.0


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
    keep: bool = False,
    pool: str = "prefork",
    group_commit: bool = False,
    shards: int = 0,
    reconcilers: int = 1,
    echo: Callable[[str], None] = print,
) -> int:
    """Run the soak; print the report; return 0 only if no invariant was broken (nothing lost,
    stuck or committed twice, no illegal transition, no child started before its parent).

    At least ``runs`` runs are driven; more are submitted while fewer than ``min_faults`` faults
    have been injected, so every fault lands on a busy deployment. Without ``database_url`` the
    soak runs its own PostgreSQL server (and may restart it); with one, that database is wiped
    and every kind but ``pg_restart`` is injected. ``claim_delay``: the workers'
    ``ORCHESTRATOR_CLAIM_DELAY`` (direct messages' bodies run before their claim).

    ``mix``: at least this many operator actions (:mod:`orchestrator.testing.chaos.mix`) at random moments,
    one every ``action_interval`` seconds or so, while the faults go on; the runs they start
    are followed too. After the last fault and the last action every run must be final within
    ``settle`` seconds, or wait on something ``explain`` names; past it the soak stops waiting and
    counts the rest as stuck. ``lacking``: with ``mix``, also run a worker without one task
    module. ``keep``: leave the logs and the private server's files behind, and say where.
    ``pool``: the workers' pool, ``prefork`` (``-c 2``) or ``threads`` (``-c 8``; no ``kill_child``:
    no pool process); ``group_commit``: the workers' ``ORCHESTRATOR_GROUP_COMMIT=1``; ``shards`` and
    ``reconcilers``: the sharded control plane (docs/shards.md). A bad option raises ChaosConfigError first.
    """
    check_pool(pool, shards, reconcilers)
    # generators of their own, so the DAGs do not depend on how the faults interleave with them
    rng = random.Random(seed)
    fault_rng = random.Random(seed + 1_000_003)
    emit_rng = random.Random(seed + 2_000_003)  # when the events come
    mix_rng = random.Random(seed + 3_000_003)  # which actions, at what
    pace_rng = random.Random(seed + 4_000_003)  # the gaps between faults
    data = Path(tempfile.mkdtemp(prefix="orc-chaos-"))
    pg: PrivatePostgres | None = None
    dep: Deployment | None = None
    orc: Orchestrator | None = None
    probe: sa.Engine | None = None
    report: dict[str, Any] = {}
    previous, window = _prepare(mix)
    try:
        if database_url is None:
            pg = PrivatePostgres()
            pg.init()
            pg.start()
            database_url = pg.url
        dep = Deployment(database_url, workers, data, pg=pg, claim_delay=claim_delay, lacking=bool(mix) and lacking,
                         pool=pool, group_commit=group_commit, shards=shards, reconcilers=reconcilers)  # fmt: skip
        orc, probe = _connect(dep)
        started = time.monotonic()
        dep.start()
        injector = Injector(dep, orc, fault_rng, echo)
        mixer = Mixer(orc, mix_rng, echo, resource=RESOURCE) if mix else None
        if mixer is not None:  # a breaker on the mix's resource, before the first run
            mixer.setup()
        loop = _Loop(orc, dep, injector, mixer, probe, rng, emit_rng, mix_rng, echo, seed=seed, mix=mix,
                     min_faults=min_faults, fault_interval=fault_interval, action_interval=action_interval,
                     settle=settle, pending=list(range(runs)), extra=runs, pace_rng=pace_rng)  # fmt: skip
        Deployment._wait(lambda: _live_workers(orc) >= len(dep.worker_procs), "workers", 90)
        loop.next_fault = time.monotonic() + 2.0
        while time.monotonic() - started < timeout and not loop.step():
            time.sleep(0.05)
        report = loop.report(time.monotonic() - started)
    finally:
        _clean_up(dep, probe, orc, pg, data, previous, window, keep=keep, echo=echo)
    return _verdict(report, echo)


def _connect(dep: Deployment) -> tuple[Orchestrator, sa.Engine]:
    """The soak's database wiped and migrated, and this process (submits, checks, duplicate
    publishes) set to talk to Redis and Postgres directly: its orchestrator and probe engine."""
    engine = make_engine(dep.database_url)
    migrate.reset(engine)
    engine.dispose()
    for k, v in dep.env().items():
        os.environ[k] = v
    from ...runtime.celery_app import get_app

    return Orchestrator(app=get_app(), store=Store(dep.database_url)), make_engine(dep.database_url)


def _prepare(mix: int) -> tuple[Any, int]:
    """Before the soak: a small map window under the mix (so clears meet windows holding items
    back), and SIGTERM turned into an exception; returns what to restore."""
    previous = None
    window = dag_bounds.MAP_WINDOW
    if mix:
        dag_bounds.MAP_WINDOW = MIX_MAP_WINDOW  # read when a submit writes a map's row
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (``timeout``, a test giving up) ends the soak through ``finally``: every
        # process it started is stopped, by its process group
        previous = signal.signal(signal.SIGTERM, _terminated)
    return previous, window


def _clean_up(
    dep: Deployment | None, probe: sa.Engine | None, orc: Orchestrator | None, pg: PrivatePostgres | None,
    data: Path, previous: Any, window: int, *, keep: bool = False, echo: Callable[[str], None] = print,
) -> None:  # fmt: skip
    """After the soak, whatever happened: every process it started stopped, its files removed
    (with ``keep``: left behind, the private server stopped, and their paths printed)."""
    if dep is not None:
        dep.stop()
    if probe is not None:
        probe.dispose()
    if orc is not None:
        with contextlib.suppress(Exception):
            orc.store.engine.dispose()
    if keep:
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.stop("fast")
            echo(f"kept: the private server's files {pg.root} (data/, server.log; port {pg.port})")
        echo(f"kept: the soak's data directory {data} (worker, reconciler and Redis logs)")
    else:
        if pg is not None:
            pg.close()
        shutil.rmtree(data, ignore_errors=True)
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    dag_bounds.MAP_WINDOW = window


def _verdict(report: dict[str, Any], echo: Callable[[str], None]) -> int:
    """Print the report; 0 only when nothing was lost, committed twice or stuck, and no other
    invariant broke."""
    for line in _format(report):
        echo(line)
    if not report:
        return 1
    clean = not (report["lost"] or report["committed_twice"] or report["stuck"] or report["other_violations"])
    return 0 if clean else 1


@dataclass
class _Loop:
    """The soak while it drives: the runs it submitted and still has to, the events due, the
    operator's actions and the faults; :meth:`step` is one turn, :meth:`report` the end."""

    orc: Orchestrator
    dep: Deployment
    injector: Injector
    mixer: Mixer | None
    probe: sa.Engine
    rng: random.Random
    emit_rng: random.Random
    mix_rng: random.Random
    echo: Callable[[str], None]
    seed: int
    mix: int
    min_faults: int
    fault_interval: float
    action_interval: float
    settle: float
    pending: list[int]
    #: the next DAG index (and idempotency key) of a run added to keep the deployment busy;
    #: never reused, even once ``db clean`` removed runs
    extra: int
    run_ids: list[str] = field(default_factory=list)
    #: (when, event) emits due: each waiting DAG's events, a little after its submit
    emits: list[tuple[float, Emit]] = field(default_factory=list)
    drawn: dict[int, DAG] = field(default_factory=dict)
    emitted: int = 0
    woken: int = 0
    finished: int = 0
    restarts: int = 0
    next_action: float = field(default_factory=lambda: time.monotonic() + 3.0)
    next_fault: float = 0.0
    next_look: float = 0.0
    #: the gaps between faults (not ``rng``: the DAGs drawn at a seed must not depend on how many
    #: faults came before each submit, so two modes soaked at one seed run the same DAGs)
    pace_rng: random.Random = field(default_factory=random.Random)

    def step(self) -> bool:
        """One turn of the soak; ``True`` once it is over (every run final, or given up)."""
        self.injector.heal_due()
        for name in self.dep.supervise():
            self.echo(f"{name} exited; restarted")
            self.restarts += 1
        up = not self.injector.db_down
        if up and time.monotonic() >= self.next_look:
            self.finished = _finished(self.orc, self.run_ids)
            self._observe()
            self.next_look = time.monotonic() + 0.25
        if up and self.pending and len(self.run_ids) - self.finished < 8:
            self._submit()
        if up and self.emits:
            self._emit_due()
        if self.mixer is not None:
            self._act(up)
        enough_faults = sum(self.injector.counts.values()) >= self.min_faults
        enough_actions = self.mixer is None or (self.mixer.count >= self.mix and not self.mixer.busy)
        if not self.pending and not (enough_faults and enough_actions):
            # faults only mean something while there is work: keep the deployment busy
            self.pending.append(self.extra)
            self.extra += 1
        if time.monotonic() >= self.next_fault and not enough_faults:
            try:
                self.injector.inject()
            except Exception as exc:  # noqa: BLE001 - a failed injection is reported, the soak goes on
                self.echo(f"fault injection failed: {exc!r}")
            self.next_fault = time.monotonic() + self.fault_interval * (0.5 + self.pace_rng.random())
        if enough_faults and enough_actions and not self.injector.heals and up:
            return self._settled()
        return False

    def _observe(self) -> None:
        with contextlib.suppress(sa.exc.DBAPIError):
            with self.probe.connect() as conn:
                self.injector.observe(int(conn.execute(PROGRESS).scalar_one()))

    def _submit(self) -> None:
        i = self.pending.pop(0)
        # a submit a fault interrupted is tried again with the same DAG and key
        dag = self.drawn.pop(i, None) or random_dag(self.rng, i, mixed=bool(self.mix))
        try:
            self.run_ids.append(self.orc.submit(dag, idempotency_key=f"chaos-{self.seed}-{i}").id)
            now = time.monotonic()
            self.emits += [(now + 3.0 * self.emit_rng.random(), e) for e in emits_for(dag, f"chaos-{self.seed}-{i}")]
        except Exception as exc:  # noqa: BLE001 - a fault hit the submit; retry the same key later
            self.echo(f"submit {i} failed during a fault ({type(exc).__name__}); retrying")
            self.pending.insert(0, i)
            self.drawn[i] = dag
            time.sleep(0.5)

    def _emit_due(self) -> None:
        due = [pair for pair in self.emits if pair[0] <= time.monotonic()]
        for pair in due:
            self.emits.remove(pair)
            e = pair[1]
            try:
                done = self.orc.events.emit(e.key, e.payload, event_id=e.event_id, tenant=e.tenant)
            except Exception as exc:  # noqa: BLE001 - a fault hit the emit; again, same event id
                self.echo(f"emit {e.key} failed during a fault ({type(exc).__name__}); retrying")
                self.emits.append((time.monotonic() + 0.5, e))
                break
            self.emitted += 0 if done.duplicate else 1
            self.woken += done.woken

    def _act(self, up: bool) -> None:
        mixer = self.mixer
        assert mixer is not None
        self.run_ids += mixer.new_runs
        mixer.new_runs.clear()
        if mixer.removed:
            self.run_ids = [r for r in self.run_ids if r not in mixer.removed]
        if up:
            # past the last action, a person answers the approvals left
            mixer.tick(self.run_ids, answer_all=mixer.count >= self.mix)
        if up and mixer.count < self.mix and time.monotonic() >= self.next_action:
            mixer.act(self.run_ids)
            self.next_action = time.monotonic() + self.action_interval * (0.5 + self.mix_rng.random())

    def _last_disturbance(self) -> float:
        return max(self.injector.last_fault, self.mixer.last_action if self.mixer else 0.0)

    def _settled(self) -> bool:
        """Past the last fault and action: whether every run is final, or the wait is given up."""
        if LACKING in self.dep.worker_procs:
            # the misconfiguration the watchdog flagged is fixed, as an operator would: the worker
            # that lacks a task module goes; the tasks it dropped and held are released
            self.echo(f"past the last fault and action: the operator stops {LACKING}")
            self.dep.retire(LACKING)
        if not self.pending and not self.emits and _finished(self.orc, self.run_ids) == len(self.run_ids):
            return True
        if time.monotonic() - self._last_disturbance() > self.settle:
            self.echo(f"not every run final {self.settle:g}s after the last fault and action: giving up waiting")
            return True
        return False

    def report(self, took: float) -> dict[str, Any]:
        """The soak's outcome, checked from the database (see :func:`_summary`)."""
        orc, mixer, run_ids = self.orc, self.mixer, self.run_ids
        self.injector.heal_due(everything=True)
        # from the last fault's end (and last action's) until every run was final: how long the
        # system took to heal
        recovered = time.monotonic() - self._last_disturbance()
        self._observe()
        problems = _safe_check(orc, run_ids) + (mixer.problems if mixer else [])
        # an open run whose every open task waits on something explain names is not stuck
        named = _named_waits(orc, run_ids)
        problems = [p for p in problems if not any(r in p for r in named)]
        if mixer is not None:
            problems = mixer.annotate(problems)
        report = _summary(orc, [r for r in run_ids if r not in named], problems, self.injector, recovered, took)
        report["named_waits"] = named
        report["explained"] = _explain_open(orc, [r for r in run_ids if r not in named])
        report["settle"] = self.settle
        if mixer is not None:
            report["actions"] = mixer.summary(problems)
            report["removed"] = len(mixer.removed)
        report["restarts"] = self.restarts
        report["emitted"], report["woken"] = self.emitted, self.woken
        report["waits"] = _waits(orc, run_ids)
        dep = self.dep
        report["mode"] = (f"{len(dep.worker_procs)} workers --pool {dep.pool} -c {POOLS[dep.pool]}, group commit"
                          f" {'on' if dep.group_commit else 'off'}, claim delay {dep.claim_delay:g}s"
                          + (f", reconciler shards {dep.shards}" if dep.shards else ""))  # fmt: skip
        if dep.shards:
            report["sharded"] = shard_summary(orc, self.injector)
        report["skipped"] = dict(self.injector.skipped)
        return report


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
    lines = [f"workers: {r['mode']}"] if r.get("mode") else []
    lines += [
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
    lines.extend(f"  {kind:<18}  not dealt: {why}" for kind, why in sorted(r.get("skipped", {}).items()))
    lines += [
        f"waits begun: {r.get('waits', 0)}  events emitted: {r.get('emitted', 0)}  waits and bodies they woke:"
        f" {r.get('woken', 0)}",
        f"processes that exited by themselves and were restarted: {r.get('restarts', 0)}",
    ]
    lines += _format_actions(r.get("actions")) + format_shards(r.get("sharded"))
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
