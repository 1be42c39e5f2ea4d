"""Why isn't it running? (pure code) — for every task of a run, the reasons it is where it is.

:func:`explain` turns what the store read (:class:`ExplainInput`: the run's task rows with their
counters, its edges, the live workers and how many READY tasks are ahead of each of the run's
READY tasks) into one :class:`Explanation` per task. Each reason has a ``kind`` a program can
switch on and a ``detail`` for people; ``orchestrator explain RUN_ID [KEY] [--json]`` prints them.

Reason kinds: ``waiting_on_parents`` (with the parents not finished and their states),
``trigger_rule`` (what the counters say so far), ``parent_dead_letter``, ``tenant_limit`` (the
run's tenant has its most tasks in flight, held by which runs), ``run_limit`` (the run has its
``max_active_tasks`` in flight), ``dag_limit`` (its DAG has its most tasks in flight across runs,
held by which runs), ``pool_full`` (the task's pool has fewer free slots than it asks, held by
which tasks), ``pool_missing``, ``rate_limit`` (no token; when the next one comes),
``rate_limit_missing``, ``breaker`` (a circuit breaker of one of the task's resources holds it:
``held: breaker stripe open until ...``, half-open with its probes out, or ramping),
``tenant_share`` (other tenants with READY work for the same workers are
further below their weighted share, so they go first; the run's tenant's slots by run),
``ready_behind`` (READY tasks admission takes first:
of higher priority, or older, in any queue the workers of its queue also consume),
``window_full`` (the live workers of its queue have every slot in use), ``no_worker`` (no live
worker consumes its queue), ``unregistered`` (``no live worker on queue Q has task T registered
(workers on Q: ...)``; for a run pinned to a code version, ``no live worker of code version V on
queue Q has task T registered (workers on Q: w (version v1), ...)``; or a worker dropped its message
as unregistered: admission holds it READY until a worker of Q that has T registers), ``stuck``
(the reconciler's watchdog flagged it: no worker can take it, its message was re-published N
times without a claim, or its run had no transition for ``ORCHESTRATOR_STUCK_RUN_SECONDS``;
``needs_attention`` is true), ``queued`` (published, waiting for a worker to take the message),
``running``, ``retry_at`` (RETRYING until ``not_before``), ``waiting`` (WAITING: for which event
and match, an instant, an approval, a sensor's next check, until when, its deadline, or ``waiting on
child run ID``; no slot), ``dead_letter`` (parked, waiting for a person), ``finished``, ``run_cancelled``.

Dynamic DAGs add: ``skipped`` (why a SKIPPED task was skipped: ``branch_not_taken``,
``short_circuit``, ``empty_map``, ``upstream_skipped``, ``user``, with the ledger's reason),
``mapped`` (a mapped node: ``mapped into N tasks: x done (a succeeded, b failed, c skipped)``),
``map_child`` (a map's child: its map and its item), ``decided`` (the ledger row that took the
task out of PENDING when it tells more than its state: an early verdict, ``early verdict (k of
n upstream done)``, or an UPSTREAM_FAILED), ``waiting_on_setup_scope`` (the setups it works under
that are not its parents, not succeeded yet: Airflow's setup constraint; ``setup_scope``). A task
in a task group has its innermost group in ``to_json``. The counters of ``trigger_rule`` count UPSTREAM_FAILED
parents apart from FAILED ones, and setup parents apart. These need the optional columns of a
task row (``skip_reason``, ``n_upstream_failed``, ``n_setup``, ``n_setup_ok``,
``n_setup_skipped``, ``min_success_ratio``, ``is_map``, ``map_parent``, ``map_index``,
``map_key``, ``map_item_from``, ``map_total`` .. ``map_skipped``) and :attr:`ExplainInput.ledger`;
a row without them is explained as before.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .dag.groups import groups_of
from .models import RateLimit
from .routing import DEFAULT_TENANT
from .states import TERMINAL, TaskState
from .workers import dropped_text, pinned_text, split_pinned, unregistered_text

T = TaskState


@dataclass(frozen=True)
class Reason:
    kind: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, **self.data}


@dataclass(frozen=True)
class Explanation:
    key: str
    state: TaskState
    reasons: list[Reason]

    def to_json(self) -> dict[str, Any]:
        group = groups_of(self.key)[-1:]  # the innermost task group it lies in (DAG.group)
        return {"key": self.key, "state": self.state.value, "reasons": [r.to_json() for r in self.reasons],
                **({"group": group[0]} if group else {})}  # fmt: skip


@dataclass(frozen=True)
class LimitUse:
    """A concurrency limit and what holds it now."""

    limit: int
    in_flight: int
    #: who holds it: run id -> tasks in flight (tenant and DAG limits), or ``run/key`` -> slots (pools)
    holders: dict[str, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.limit - self.in_flight


@dataclass(frozen=True)
class ExplainInput:
    run_state: str
    #: the run's task rows (``key``, ``state``, ``attempt``, ``max_attempts``, ``trigger_rule``,
    #: ``n_upstream``, ``n_done``, ``n_succeeded``, ``n_failed``, ``n_skipped``, ``queue``,
    #: ``priority``, ``not_before``, ``dispatched_at``, ``worker``, ``lease_expires_at``)
    tasks: Sequence[Any]
    #: (parent key, child key) of the run
    edges: Sequence[tuple[str, str]]
    #: live workers: (queues, concurrency)
    workers: Sequence[tuple[Sequence[str], int]]
    #: READY tasks admission takes before each of the run's READY tasks (by key)
    ahead: dict[str, int]
    #: tasks QUEUED or RUNNING per queue (the live groups' windows are counted from these)
    in_flight: dict[str, int]
    depth: int
    now: dt.datetime
    tenant: str = DEFAULT_TENANT
    dag: str = ""
    #: the limits that apply to the run's tasks, where set: the tenant's, the run's own
    #: (max_active_tasks), the DAG's across runs
    tenant_limit: LimitUse | None = None
    run_limit: LimitUse | None = None
    dag_limit: LimitUse | None = None
    #: the pools the run's READY tasks name (None: the pool does not exist)
    pools: dict[str, LimitUse | None] = field(default_factory=dict)
    #: the rate limits the run's READY tasks name (None: it does not exist)
    rates: dict[str, RateLimit | None] = field(default_factory=dict)
    #: the circuit breakers of the run's READY tasks' resources that hold them now: name -> why
    #: (``breaker stripe open until ...``)
    breakers: dict[str, str] = field(default_factory=dict)
    #: per queue of the run's READY tasks, the fair share on the workers consuming it: tenant ->
    #: (tasks in flight on those workers' queues, weight, has READY work there)
    shares: dict[str, dict[str, tuple[int, float, bool]]] = field(default_factory=dict)
    #: the run's tenant's tasks in flight per run (who uses its share)
    tenant_runs: dict[str, int] = field(default_factory=dict)
    #: per task, ledger rows that decided it: ``{"decided": row, "SKIPPED": row, ...}`` (the
    #: newest row out of PENDING, and the newest row into each state), each ``{"from", "to",
    #: "reason"}``
    ledger: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: per queue of the run's READY tasks: each live worker consuming it -> the task names it
    #: registered (``None``: a worker that does not say, which takes every name); a queue absent
    #: here is not checked
    registered: dict[str, dict[str, list[str] | None]] = field(default_factory=dict)
    #: per queue ``Q`` of the run's READY tasks pinned to a code version (their queue ``Q@V``):
    #: each live worker consuming ``Q`` -> the code version it advertises (``None``: it did not say)
    versions: dict[str, dict[str, str | None]] = field(default_factory=dict)


#: what each skip reason means (``states.SkipReason``; the ledger row says which task did it)
SKIP_REASONS = {
    "branch_not_taken": "a branch upstream followed other tasks",
    "short_circuit": "a short circuit upstream returned a falsy result",
    "empty_map": "its map had no items (on_empty='skip')",
    "upstream_skipped": "its trigger rule decided SKIPPED from skipped upstream tasks",
    "user": "the task raised orchestrator.Skip",
    "wait_timeout": "its wait's deadline passed (on_timeout='skip')",
}


def explain(data: ExplainInput, key: str | None = None) -> list[Explanation]:
    """One explanation per task of the run (or only ``key``), in the order of the rows."""
    by_key = {t.key: t for t in data.tasks}
    parents: dict[str, list[str]] = {}
    for parent, child in data.edges:
        parents.setdefault(child, []).append(parent)
    out = []
    for t in data.tasks:
        if key is not None and t.key != key:
            continue
        ups = [p for p in parents.get(t.key, []) if p in by_key]
        item_from = getattr(t, "map_item_from", None)
        if item_from is not None and item_from in by_key and item_from not in ups:
            ups.append(item_from)  # a chained map's child waits on its item's child of the map before
        reasons = _reasons(t, ups, by_key, data)
        stuck = _stuck(t)
        if stuck is not None:
            reasons.insert(0, stuck)
        if getattr(t, "map_parent", None) is not None:
            reasons.insert(0 if reasons and reasons[0].kind != "run_cancelled" else len(reasons), _child(t))
        decided = _decided(t, data)
        if decided is not None:
            reasons.append(decided)
        out.append(Explanation(t.key, TaskState(t.state), reasons))
    return out


def _child(t: Any) -> Reason:
    item_from = getattr(t, "map_item_from", None)
    chained = f", mapped item by item from {item_from}" if item_from else ""
    return Reason(
        "map_child",
        f"item {t.map_index} (key {t.map_key}) of map {t.map_parent}{chained}",
        {"map": t.map_parent, "index": t.map_index, "map_key": t.map_key, "item_from": item_from},
    )


def map_counts(t: Any) -> dict[str, int] | None:
    """A mapped node's children counted (``total``, ``done``, ``succeeded``, ``failed``,
    ``skipped``) once it expanded, else ``None``."""
    if not getattr(t, "is_map", False) or TaskState(t.state) is T.PENDING:
        return None
    return {"total": t.map_total, "done": t.map_done, "succeeded": t.map_ok, "failed": t.map_failed,
            "skipped": t.map_skipped}  # fmt: skip


def mapped_text(counts: dict[str, int]) -> str:
    """``mapped into N tasks: x done (a succeeded, b failed, c skipped)``."""
    return (
        f"mapped into {counts['total']:,} task(s): {counts['done']:,} done ({counts['succeeded']:,} succeeded,"
        f" {counts['failed']:,} failed, {counts['skipped']:,} skipped)"
    )


def waiting_reason(waiting: dict[str, Any] | None, child: str | None = None) -> Reason:
    """What a WAITING task waits for (its ``waiting`` column; ``child``: a child-run node's run)."""
    w, kind = dict(waiting or {}), (waiting or {}).get("kind")
    if kind == "child":
        return Reason("waiting", f"waiting on child run {child or '(being started)'}; no slot", {"child_run": child})
    if kind == "approval":
        what = "an approval: orchestrator approve | reject RUN KEY (or the run page)"
    elif kind == "sensor":
        what = "its sensor's next check"
    elif w.get("event"):
        what = f"event {w['event']}" + (f" whose payload contains {w['match']}" if w.get("match") else "")
    else:
        what = "its time"
    if w.get("until"):
        what += f" until {w['until']}"
    if kind == "defer":
        what = f"the body deferred: {what}"
    if w.get("deadline"):
        what += f"; deadline {w['deadline']} (then {'skipped' if w.get('on_timeout') == 'skip' else 'WaitTimeout'})"
    return Reason("waiting", f"waits for {what}; it holds no worker slot", {"waiting": w})


def skipped_text(reason: str | None, ledger: str | None = None) -> str:
    """``branch_not_taken (a branch upstream followed other tasks); ledger: ...`` (the detail of
    a ``skipped`` reason)."""
    meaning = SKIP_REASONS.get(reason or "", "")
    text = f"{reason or 'by an operator'}" + (f" ({meaning})" if meaning else "")
    return text + (f"; ledger: {ledger}" if ledger else "")


def _decided(t: Any, data: ExplainInput) -> Reason | None:
    """The verdict that took ``t`` out of PENDING, when it says more than the state: an early
    verdict, or an UPSTREAM_FAILED (which parent)."""
    row = data.ledger.get(t.key, {}).get("decided")
    if row is None or TaskState(t.state) is T.SKIPPED:
        return None
    reason = row.get("reason") or ""
    if "early verdict" not in reason and row.get("to") != T.UPSTREAM_FAILED.value:
        return None
    return Reason("decided", f"{row.get('from')} -> {row.get('to')}: {reason}", dict(row))


def _reasons(t: Any, parents: list[str], by_key: dict[str, Any], data: ExplainInput) -> list[Reason]:
    state = TaskState(t.state)
    if data.run_state == "CANCELLED" and state not in TERMINAL and state is not T.MAPPED:
        return [Reason("run_cancelled", "the run was cancelled")]
    counts = map_counts(t)
    if state is T.MAPPED and counts is not None:
        return [Reason("mapped", mapped_text(counts), {"map": counts})]
    if state is T.SKIPPED:
        reason = getattr(t, "skip_reason", None)
        row = data.ledger.get(t.key, {}).get("SKIPPED") or {}
        found = [
            Reason(
                "skipped",
                skipped_text(reason, row.get("reason")),
                {"skip_reason": reason, "ledger_reason": row.get("reason")},
            )
        ]
        if counts is not None and counts["total"]:
            found.append(Reason("mapped", mapped_text(counts), {"map": counts}))
        return found
    if state is T.PENDING:
        return _pending(t, parents, by_key)
    if state is T.READY:
        return _ready(t, data)
    if state is T.QUEUED:
        since = _ago(data.now, t.dispatched_at)
        reasons = [Reason("queued", f"published {since}, waiting for a worker to take the message", {})]
        if not _consumers(t.queue, data):
            reasons.append(_no_worker(t.queue))
        return reasons
    if state is T.RUNNING:
        return [Reason("running", f"running on {t.worker or 'a worker'} (attempt {t.attempt})", {"worker": t.worker})]
    if state is T.RETRYING:
        at = t.not_before.isoformat() if t.not_before else "now"
        return [
            Reason(
                "retry_at",
                f"attempt {t.attempt} of {t.max_attempts} waits for its backoff until {at}",
                {"not_before": at, "attempt": t.attempt},
            )
        ]
    if state is T.WAITING:
        return [waiting_reason(getattr(t, "waiting", None), getattr(t, "child_run_id", None))]
    if state is T.DEAD_LETTER:
        return [
            Reason(
                "dead_letter",
                "parked after the same failure on consecutive attempts (or a crash loop): retry, skip or fail it",
            )
        ]
    found = [Reason("finished", f"finished {state.value}")]
    if counts is not None:
        found.append(Reason("mapped", mapped_text(counts), {"map": counts}))
    return found


def _pending(t: Any, parents: list[str], by_key: dict[str, Any]) -> list[Reason]:
    open_parents = [p for p in parents if TaskState(by_key[p].state) not in TERMINAL]
    reasons = []
    if open_parents:
        states = {p: by_key[p].state for p in sorted(open_parents)}
        shown = ", ".join(f"{p} ({s})" for p, s in list(states.items())[:10])
        more = f" and {len(states) - 10} more" if len(states) > 10 else ""
        reasons.append(
            Reason("waiting_on_parents", f"waits on {len(states)} parent(s): {shown}{more}", {"parents": states})
        )
    dead = sorted(p for p in parents if by_key[p].state == T.DEAD_LETTER.value)
    if dead:
        reasons.append(
            Reason(
                "parent_dead_letter",
                f"parent(s) {', '.join(dead)} parked in DEAD_LETTER: nothing moves until a person acts",
                {"parents": dead},
            )
        )
    scope = {k: by_key[k].state for k in getattr(t, "setup_scope", None) or [] if k in by_key}
    if open_scope := {k: v for k, v in scope.items() if v != T.SUCCEEDED.value}:
        shown = ", ".join(f"{k} ({v})" for k, v in open_scope.items())
        detail = f"waits for the setup(s) it works under, not its parents (Airflow's setup constraint): {shown}"
        reasons.append(Reason("waiting_on_setup_scope", detail, {"setups": open_scope}))
    up_failed = getattr(t, "n_upstream_failed", None)
    n_setup = getattr(t, "n_setup", 0) or 0
    ratio = getattr(t, "min_success_ratio", None)
    failed = f" {t.n_failed} failed," + (f" {up_failed} upstream failed," if up_failed is not None else "")
    setup = f"; setup parents: {t.n_setup_ok} of {n_setup} succeeded, {t.n_setup_skipped} skipped" if n_setup else ""
    needs = f"; needs {ratio:.0%} of them succeeded" if ratio is not None else ""
    data: dict[str, Any] = {
        "rule": t.trigger_rule,
        "total": t.n_upstream,
        "done": t.n_done,
        "succeeded": t.n_succeeded,
        "failed": t.n_failed,
        "skipped": t.n_skipped,
    }
    if up_failed is not None:
        data["upstream_failed"] = up_failed
    if n_setup:
        data["setup"] = {"total": n_setup, "succeeded": t.n_setup_ok, "skipped": t.n_setup_skipped}
    if ratio is not None:
        data["min_success_ratio"] = ratio
    then = "; then maps into one task per item" if getattr(t, "is_map", False) else ""
    reasons.append(
        Reason(
            "trigger_rule",
            f"{t.trigger_rule}: {t.n_done} of {t.n_upstream} parents done ({t.n_succeeded} succeeded,{failed}"
            f" {t.n_skipped} skipped){setup}{needs}; not decided yet{then}",
            data,
        )
    )
    return reasons


def _stuck(t: Any) -> Reason | None:
    """The watchdog's flag (``orc_tasks.stuck``): the task needs a person."""
    flag = getattr(t, "stuck", None)
    if not flag:
        return None
    return Reason(
        "stuck",
        f"needs attention (the watchdog, since {flag.get('at')}): {flag.get('kind')}: {flag.get('detail')}",
        {"stuck": dict(flag)},
    )


def _unregistered(t: Any, data: ExplainInput) -> Reason | None:
    """A READY task that admission holds because no live worker of its queue registered its
    task, or because a worker dropped its message as unregistered (``dropped_by``)."""
    workers = data.registered.get(t.queue)
    name = getattr(t, "task_name", None)
    if workers is None or name is None:
        return None
    having = sorted(w for w, names in workers.items() if names is None or name in names)
    dropped = getattr(t, "dropped_by", None)
    info = {"queue": t.queue, "task_name": name, "workers": sorted(workers), "registered_on": having}
    if dropped is not None:
        return Reason(
            "unregistered",
            dropped_text(dropped, name, t.queue, having),
            {**info, "dropped_by": dropped},
        )
    if having:
        return None
    return Reason("unregistered", unregistered_text(t.queue, name, sorted(workers)), info)


def _pinned(t: Any, data: ExplainInput) -> Reason | None:
    """A READY task of a run pinned to a code version V (its queue ``Q@V``) that no live worker of
    V consuming Q has registered: admission holds it (a worker that dropped its message is
    :func:`_unregistered`'s)."""
    base, version = split_pinned(t.queue)
    name = getattr(t, "task_name", None)
    if version is None or name is None or getattr(t, "dropped_by", None) is not None:
        return None
    workers = data.registered.get(t.queue, {})
    if any(names is None or name in names for names in workers.values()):
        return None
    on_base = data.versions.get(base, {})
    info = {
        "queue": t.queue, "task_name": name, "code_version": version, "unpinned_queue": base,
        "workers": sorted(on_base), "versions": dict(sorted(on_base.items())), "registered_on": [],
    }  # fmt: skip
    return Reason("unregistered", pinned_text(base, version, name, on_base), info)


def _ready(t: Any, data: ExplainInput) -> list[Reason]:
    pinned = _pinned(t, data)
    if pinned is not None:  # admission does not look at it: nothing else matters
        return [pinned]
    groups = _consumers(t.queue, data)
    if not groups:
        return [_no_worker(t.queue)]
    unregistered = _unregistered(t, data)
    if unregistered is not None:  # admission does not look at it: nothing else matters
        return [unregistered]
    reasons = _limits(t, data)
    if reasons:  # held by a limit: what else is READY or in flight does not matter until it frees
        return reasons
    share = _share(t, data)
    if share is not None:
        reasons.append(share)
    ahead = data.ahead.get(t.key, 0)
    if ahead:
        reasons.append(
            Reason(
                "ready_behind",
                f"READY behind {ahead} task(s) that admission takes first (higher priority, or older)"
                f" for the workers of {t.queue}",
                {"ahead": ahead, "queue": t.queue},
            )
        )
    full = []
    for queues, capacity in groups:
        used = sum(data.in_flight.get(q, 0) for q in queues)
        window = capacity * data.depth
        if used >= window:
            full.append({"queues": sorted(queues), "in_flight": used, "window": window})
    if full and len(full) == len(groups):
        g = full[0]
        reasons.append(
            Reason(
                "window_full",
                f"every slot of the workers consuming {t.queue} is in use ({g['in_flight']} in flight,"
                f" window {g['window']} = capacity x depth {data.depth})",
                {"groups": full},
            )
        )
    if not reasons:
        reasons.append(Reason("ready", "READY: the next admission (a completion or the reconciler's pass) takes it"))
    return reasons


def _limits(t: Any, data: ExplainInput) -> list[Reason]:
    """The limits holding back the READY task ``t`` (admission's ``limits.held``, in words)."""
    reasons = []
    for name in getattr(t, "resources", None) or ():
        held = data.breakers.get(name)
        if held is not None:
            # admission looks at the breakers first: nothing else matters while one holds
            return [Reason("breaker", f"held: {held}", {"breaker": name})]
    for kind, use, what, setting in (
        (
            "tenant_limit",
            data.tenant_limit,
            f"tenant {data.tenant}",
            f"orchestrator tenant set {data.tenant} --max-running",
        ),
        ("run_limit", data.run_limit, "the run", "the DAG's max_active_tasks"),
        (
            "dag_limit",
            data.dag_limit,
            f"DAG {data.dag}",
            f"orchestrator --tenant {data.tenant} dag set {data.dag} --max-running",
        ),
    ):
        if use is not None and use.free <= 0:
            held = _holders(use.holders, "run")
            reasons.append(
                Reason(
                    kind,
                    f"{what} has {use.in_flight} task(s) in flight, its limit ({setting} {use.limit}){held}",
                    {"limit": use.limit, "in_flight": use.in_flight, "held_by": dict(use.holders)},
                )
            )
    pool = getattr(t, "pool", None)
    if pool is not None:
        use = data.pools.get(pool)
        if use is None:
            reasons.append(
                Reason(
                    "pool_missing",
                    f"pool {pool} does not exist: orchestrator pool set {pool} --slots N",
                    {"pool": pool},
                )
            )
        elif use.free < t.pool_slots:
            reasons.append(
                Reason(
                    "pool_full",
                    f"pool {pool} has {max(use.free, 0)} of {use.limit} slot(s) free, the task needs"
                    f" {t.pool_slots}{_holders(use.holders, 'task')}",
                    {
                        "pool": pool,
                        "slots": use.limit,
                        "used": use.in_flight,
                        "needs": t.pool_slots,
                        "held_by": dict(use.holders),
                    },
                )
            )
    key = getattr(t, "rate_limit", None)
    if key is not None:
        rate = data.rates.get(key)
        if rate is None:
            reasons.append(
                Reason(
                    "rate_limit_missing",
                    f"rate limit {key} does not exist: orchestrator limit set {key} --rate 10/s",
                    {"rate_limit": key},
                )
            )
        elif rate.tokens < 1:
            at = data.now + dt.timedelta(seconds=rate.next_token_in())
            reasons.append(
                Reason(
                    "rate_limit",
                    f"rate limit {key} ({rate.rate_text}, burst {rate.burst}) has no token;"
                    f" the next at {at.isoformat()}",
                    {"rate_limit": key, "rate": rate.rate, "burst": rate.burst, "next_token_at": at.isoformat()},
                )
            )
    return reasons


def _share(t: Any, data: ExplainInput) -> Reason | None:
    """``tenant_share``: other tenants with READY work for the same workers are further below
    their weighted share of the slots, so admission serves them first."""
    tenants = data.shares.get(t.queue, {})
    mine = tenants.get(data.tenant)
    if mine is None:
        return None
    level = (mine[0] + 1) / mine[1]
    first = {n: (f, w) for n, (f, w, ready) in tenants.items() if ready and n != data.tenant and (f + 1) / w < level}
    if not first:
        return None
    shown = ", ".join(f"{n} ({f} at weight {w:g})" for n, (f, w) in sorted(first.items())[:5])
    return Reason(
        "tenant_share",
        f"tenant {data.tenant} has {mine[0]} task(s) in flight on the workers of {t.queue} at weight {mine[1]:g};"
        f" tenants further below their share go first: {shown}{_holders(data.tenant_runs, 'run')}",
        {
            "tenant": data.tenant,
            "in_flight": mine[0],
            "weight": mine[1],
            "first": {n: {"in_flight": f, "weight": w} for n, (f, w) in first.items()},
            "held_by": dict(data.tenant_runs),
        },
    )


def _holders(holders: dict[str, int], what: str) -> str:
    if not holders:
        return ""
    top = sorted(holders.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{name} ({n})" for name, n in top[:5])
    more = f" and {len(top) - 5} more" if len(top) > 5 else ""
    return f"; held by {what} {shown}{more}"


def _consumers(queue: str, data: ExplainInput) -> list[tuple[frozenset[str], int]]:
    groups: dict[frozenset[str], int] = {}
    for queues, concurrency in data.workers:
        key = frozenset(queues)
        groups[key] = groups.get(key, 0) + int(concurrency)
    return [(qs, c) for qs, c in groups.items() if queue in qs]


def _no_worker(queue: str) -> Reason:
    return Reason("no_worker", f"no live worker consumes {queue}: start one with -Q {queue}", {"queue": queue})


def _ago(now: dt.datetime, then: dt.datetime | None) -> str:
    if then is None:
        return "at an unknown time"
    seconds = (now - then).total_seconds()
    return f"{seconds:.1f}s ago"
