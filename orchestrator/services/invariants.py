"""The promise, checked from the database alone (fault tests and the chaos soak use this).

:func:`check_runs` returns one line per violation; an empty list means the runs kept every
invariant of ARCHITECTURE.md section 2 that the database can show.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from ..core.states import (
    ANNOTATIONS,
    DEADLINE_MISSED,
    REMOVED,
    RUN_TRANSITIONS,
    TERMINAL,
    TRANSITIONS,
    RunState,
    TaskState,
)
from ..store import Store

_OUTCOMES = {"SUCCEEDED", "FAILED", "RETRYING", "DEAD_LETTER"}
#: an operator's event into these starts a new generation of the task (a clear, a mark)
_NEW_GENERATION = {"PENDING", "SUCCEEDED", "FAILED", "SKIPPED"}
#: what a map closes as; an operator that reopens one (a clear of its children) starts a generation
_CLOSED = {"SUCCEEDED", "FAILED", "SKIPPED"}
#: annotations recorded at most once per run and per task (a map child may be removed by each
#: clear that expands its map again)
_ONCE = {DEADLINE_MISSED}
#: trigger rules that may start a task before all of its upstream is done (an early verdict
#: READY), with the upstream states of which one must have come first (``always``: none)
_EARLY: dict[str, frozenset[str]] = {
    "one_success": frozenset({"SUCCEEDED"}),
    "one_failed": frozenset({"FAILED", "UPSTREAM_FAILED"}),
    "one_done": frozenset({"SUCCEEDED", "FAILED"}),
    "always": frozenset(),
}
#: terminal task states, by value
_TERMINAL = frozenset(st.value for st in TERMINAL)
#: the states a map's header closes in after its last child
_CLOSED = {"SUCCEEDED", "FAILED", "SKIPPED"}


def check_runs(
    store: Store, run_ids: Iterable[str], *, allow_dead_letter: bool = False, in_progress_ok: bool = False
) -> list[str]:
    """Violations across ``run_ids``:

    - every task terminal (DEAD_LETTER too when ``allow_dead_letter``), every run final
      (``in_progress_ok``: a run still RUNNING may have open tasks: ``orchestrator verify``);
    - at most one accepted SUCCEEDED per task and generation (an operator's clear or mark
      starts a new one: a cleared task holds one result per clear, in order), exactly one in the
      last generation of a SUCCEEDED task, and its attempt is the row's attempt;
    - every execution recorded in ``orc_probe_effects`` beyond the first of an attempt is
      matched by an outcome event (accepted or rejected) of that attempt, a refused claim, a
      redelivery of its message (``orc_deliveries``) or its re-publish by the reconciler: a
      direct message's body runs before its claim, and one whose worker died before the claim
      leaves the message's redelivery or re-publish as its record;
    - parents finished before their children started; a parent that is a map counts as its
      children (each one upstream), and a task whose trigger rule may start early
      (``one_success``, ``one_failed``, ``one_done``: one of them came first; ``always``)
      is exempt; a child of a map started after its header's upstream finished, a child of a
      chained map after its item (the earlier stage's child of the same key) succeeded;
    - every map's children exist once each, keyed ``header[map_key]`` with map indexes
      0..n-1, n being the header's ``map_total`` (a map cancelled while an insert window held
      items back: those it made); a header closed after its children
      (SUCCEEDED / FAILED / SKIPPED) counts them as their states say, closed in the state
      they decide and after the last of them finished (in the ledger's order);
    - only legal transitions were accepted (tasks and runs), and attempts never went backwards,
      nor repeated across generations: a map's child expanded again starts after every attempt
      its key used (each message's Celery task id ``<run>.<key>.<attempt>`` is new, never one a
      clear revoked);
    - every final run's ledger ends with its accepted transition to that state;
    - annotation events (a non-null ``kind``, ``states.ANNOTATIONS``: ``deadline_missed``)
      change no state (``from_state`` = ``to_state``), are of a known kind written by a role
      allowed to, and are recorded at most once per run and per task; they are not transitions,
      so the checks above leave them out.
    """
    ids = list(run_ids)
    problems: list[str] = []
    if not ids:
        return problems
    snap = store.reads.snapshot(ids)
    tasks, runs = snap.tasks, snap.runs
    problems.extend(_check_annotations([e for e in snap.events if _kind(e) is not None]))
    transitions = [e for e in snap.events if _kind(e) is None]
    events = [e for e in transitions if e.key is not None]
    run_events = [e for e in transitions if e.key is None]
    by_key = {(t.run_id, t.key): t for t in tasks}
    problems.extend(_check_final(tasks, runs, allow_dead_letter, in_progress_ok))
    walk = _Walk()
    removals = [e for e in snap.events if _kind(e) == REMOVED and e.key is not None and e.accepted]
    problems.extend(walk.run(events, removals))
    problems.extend(walk.check_results(tasks))
    problems.extend(_check_executions(snap.effects, walk.outcome_events, snap.redeliveries))
    problems.extend(_check_run_ledger(run_events, runs))
    children = _map_children(tasks)
    problems.extend(_check_maps(tasks, by_key, children, events))
    problems.extend(_check_order(snap.edges, by_key, children, walk.generation))
    return problems


def _check_final(tasks: list[Any], runs: list[Any], allow_dead_letter: bool, in_progress_ok: bool) -> list[str]:
    """Every task terminal and every run final (see :func:`check_runs`)."""
    problems: list[str] = []
    allowed = {st.value for st in TERMINAL} | ({TaskState.DEAD_LETTER.value} if allow_dead_letter else set())
    running = {r.id for r in runs if r.state == "RUNNING"} if in_progress_ok else set()
    for t in tasks:
        if t.state not in allowed and t.run_id not in running:
            problems.append(f"{t.run_id}.{t.key}: stuck in {t.state} (attempt {t.attempt})")
    if not allow_dead_letter and not in_progress_ok:
        problems.extend(f"run {r.id}: not final ({r.state})" for r in runs if r.state == "RUNNING")
    return problems


class _Walk:
    """The task ledger walked in order: an operator's clear or mark starts a new generation of the
    task; each generation holds at most one accepted result (a cleared task holds one per clear, in
    order), the last one exactly one when the row is SUCCEEDED, of the row's attempt; transitions
    legal, attempts never going back, nor repeated across generations."""

    def __init__(self) -> None:
        self.accepted_success: Counter[tuple[str, str, int]] = Counter()
        self.success_attempt: dict[tuple[str, str, int], int] = {}
        self.generation: Counter[tuple[str, str]] = Counter()
        self.outcome_events: Counter[tuple[str, str, int]] = Counter()
        self.last_attempt: dict[tuple[str, str], int] = {}
        #: tasks removed (their map expanded again) whose new row has no accepted transition yet
        self.removed: set[tuple[str, str]] = set()

    def run(self, events: list[Any], removals: list[Any]) -> list[str]:
        problems: list[str] = []
        for e in sorted([*events, *removals], key=lambda ev: ev.id):
            k = (e.run_id, e.key)
            if _kind(e) == REMOVED:
                # a map expanded again: a new task of the same key, whose attempts continue after these
                self.generation[k] += 1
                self.removed.add(k)
                continue
            if (
                e.from_state == "RUNNING"
                or e.to_state in _OUTCOMES
                or (e.to_state == "RUNNING" and not e.accepted)
                or (e.from_state == e.to_state == "QUEUED" and e.accepted)
            ):
                # a refused claim records an execution too: a direct message's body runs before its
                # claim (a duplicate delivery's is refused when its body ends or its claim delay is up);
                # so does a re-publish: the message of a direct body that died before its claim
                self.outcome_events[(e.run_id, e.key, e.attempt)] += 1
            if not e.accepted:
                continue
            if (
                e.actor == "operator"
                and e.from_state != e.to_state
                and (e.to_state in _NEW_GENERATION or (e.to_state == "MAPPED" and e.from_state in _CLOSED))
            ):
                # (a closed map that a clear of its children reopens closes again: a new generation)
                self.generation[k] += 1
            if e.to_state == "SUCCEEDED":
                g = (e.run_id, e.key, self.generation[k])
                self.accepted_success[g] += 1
                self.success_attempt[g] = e.attempt
            if e.from_state is not None:
                legal = TRANSITIONS.get((TaskState(e.from_state), TaskState(e.to_state)))
                if legal is None or e.actor not in legal:
                    problems.append(f"{e.run_id}.{e.key}: illegal {e.from_state} -> {e.to_state} by {e.actor}")
            if k in self.removed:
                self.removed.discard(k)
                if e.attempt <= self.last_attempt.get(k, 0):
                    problems.append(
                        f"{e.run_id}.{e.key}: expanded again at attempt {e.attempt}, which an earlier generation used"
                        " (its Celery task id repeats one the clear revoked)"
                    )
            elif e.attempt < self.last_attempt.get(k, 0):
                problems.append(f"{e.run_id}.{e.key}: attempt went back from {self.last_attempt[k]} to {e.attempt}")
            self.last_attempt[k] = max(self.last_attempt.get(k, 0), e.attempt)
        return problems

    def check_results(self, tasks: list[Any]) -> list[str]:
        problems: list[str] = []
        for (run_id, key, _), n in self.accepted_success.items():
            if n > 1:
                problems.append(f"{run_id}.{key}: {n} accepted results (committed twice)")
        for t in tasks:
            current = (t.run_id, t.key, self.generation[(t.run_id, t.key)])
            if t.state == "SUCCEEDED" and self.accepted_success[current] != 1:
                problems.append(f"{t.run_id}.{t.key}: SUCCEEDED without exactly one accepted result")
            elif t.state == "SUCCEEDED" and self.success_attempt[current] != t.attempt:
                problems.append(
                    f"{t.run_id}.{t.key}: success accepted for attempt {self.success_attempt[current]},"
                    f" row at {t.attempt}"
                )
        return problems


def _check_executions(
    effects: list[Any], outcome_events: Counter[tuple[str, str, int]], redeliveries: dict[str, int]
) -> list[str]:
    """Every execution beyond an attempt's first left a record (see :func:`check_runs`)."""
    problems: list[str] = []
    for run_id, key, attempt, n in effects:
        # a redelivered message stands for a delivery whose worker died: a direct message's body
        # that died before its claim wrote nothing else
        recorded = outcome_events[(run_id, key, attempt)] + redeliveries.get(f"{run_id}.{key}.{attempt}", 0)
        if n > 1 and recorded < n:
            problems.append(
                f"{run_id}.{key} attempt {attempt}: {n} executions but {outcome_events[(run_id, key, attempt)]}"
                " outcome events (an extra execution left no record)"
            )
    return problems


def _check_run_ledger(run_events: list[Any], runs: list[Any]) -> list[str]:
    """Runs' transitions legal, and each run's state the last its ledger accepted."""
    problems: list[str] = []
    last_run_state: dict[str, str] = {}
    for e in run_events:
        if not e.accepted:
            continue
        src = RunState(e.from_state) if e.from_state else None
        legal = RUN_TRANSITIONS.get((src, RunState(e.to_state)))
        if legal is None or e.actor not in legal:
            problems.append(f"run {e.run_id}: illegal {e.from_state} -> {e.to_state} by {e.actor}")
        last_run_state[e.run_id] = e.to_state
    for r in runs:
        if last_run_state.get(r.id) != r.state:
            problems.append(f"run {r.id}: is {r.state} but its ledger says {last_run_state.get(r.id)}")
    return problems


def _check_order(
    edges: list[Any],
    by_key: dict[tuple[str, str], Any],
    children: dict[tuple[str, str], list[Any]],
    generation: Counter[tuple[str, str]],
) -> list[str]:
    """Parents finished before their children started; a map's child after its header's upstream
    or, chained, after its item (see :func:`check_runs`)."""
    problems: list[str] = []
    parents: dict[tuple[str, str], list[str]] = defaultdict(list)
    for e in edges:
        parents[(e.run_id, e.child_key)].append(e.parent_key)
    for (run_id, child), ps in parents.items():
        c = by_key.get((run_id, child))
        if c is None or c.started_at is None:
            continue
        # a parent an operator cleared or marked may have run again after this child ran (a
        # clear without --downstream, a mark): its newest finish says nothing of that order
        # (so may a map's child: a map parent one of whose children an operator cleared or marked)
        ps = [
            p
            for p in ps
            if not generation[(run_id, p)]
            and not any(generation[(run_id, c.key)] for c in children.get((run_id, p), ()))
        ]
        problems.extend(_started_early(f"{run_id}.{child}", c.started_at, c.trigger_rule, run_id, ps, by_key, children))
    for (run_id, header), kids in children.items():
        h = by_key.get((run_id, header))
        if h is None:
            continue
        for c in kids:
            if c.started_at is None:
                continue
            where = f"{run_id}.{c.key}"
            if c.map_item_from is not None:
                # a chained map's child waits for its item only: the earlier stage's child of its key
                item = by_key.get((run_id, c.map_item_from))
                if generation[(run_id, c.map_item_from)]:
                    continue  # an item an operator cleared or marked may have run again after this child
                if item is None:
                    problems.append(f"{where}: its item {c.map_item_from} does not exist")
                elif item.state != "SUCCEEDED" or item.finished_at is None or item.finished_at > c.started_at:
                    problems.append(f"{where}: started before its item {c.map_item_from} succeeded")
                continue
            # a map's child is made READY by its header's expansion: after the header's upstream
            # (a source an operator cleared or marked may have run again after the child ran, as above)
            ups = [p for p in parents.get((run_id, header), []) if not generation[(run_id, p)]]
            problems.extend(_started_early(where, c.started_at, h.trigger_rule, run_id, ups, by_key, children))
    return problems


def _kind(event: object) -> str | None:
    """The annotation kind of a ledger row (``None``: a transition)."""
    kind = getattr(event, "kind", None)
    return kind if isinstance(kind, str) else None


def _check_annotations(annotations: list[Any]) -> list[str]:
    problems: list[str] = []
    seen: Counter[tuple[str, str | None, str]] = Counter()
    for e in annotations:
        kind = _kind(e) or ""
        where = f"{e.run_id}.{e.key}" if e.key is not None else f"run {e.run_id}"
        allowed = ANNOTATIONS.get(kind)
        if allowed is None:
            problems.append(f"{where}: unknown ledger annotation {kind!r}")
            continue
        if e.actor not in allowed:
            problems.append(f"{where}: {kind} recorded by {e.actor}")
        if e.from_state != e.to_state:
            problems.append(f"{where}: {kind} annotation changed the state {e.from_state} -> {e.to_state}")
        if e.accepted and kind in _ONCE:
            seen[(e.run_id, e.key, kind)] += 1
    for (run_id, key, kind), n in seen.items():
        if n > 1:
            where = f"{run_id}.{key}" if key is not None else f"run {run_id}"
            problems.append(f"{where}: {kind} recorded {n} times")
    return problems


def _map_children(tasks: list[Any]) -> dict[tuple[str, str], list[Any]]:
    """Each map header's children, by (run, header key), in map order."""
    children: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for t in tasks:
        if t.map_parent is not None:
            children[(t.run_id, t.map_parent)].append(t)
    for kids in children.values():
        kids.sort(key=lambda t: (t.map_index is None, t.map_index or 0, t.key))
    return children


def _relevant(run_id: str, key: str, by_key: dict[tuple[str, str], Any], children: dict[Any, list[Any]]) -> list[Any]:
    """The upstream rows a parent stands for: a map header's children, else the parent itself."""
    kids = children.get((run_id, key))
    if kids:
        return kids
    row = by_key.get((run_id, key))
    return [row] if row is not None else []


def _started_early(
    where: str,
    started: Any,
    rule: str,
    run_id: str,
    parent_keys: list[str],
    by_key: dict[tuple[str, str], Any],
    children: dict[Any, list[Any]],
) -> list[str]:
    """Why a task that started at ``started`` started too early for its rule, or nothing."""
    early = _EARLY.get(rule)
    if early is not None:
        if not early or not parent_keys:
            return []
        ups = [u for p in parent_keys for u in _relevant(run_id, p, by_key, children)]
        if any(u.state in early and u.finished_at is not None and u.finished_at <= started for u in ups):
            return []
        return [f"{where}: started ({rule}) before any upstream {'/'.join(sorted(early))} finished"]
    problems = []
    for p in parent_keys:
        parent = by_key.get((run_id, p))
        if parent is None or parent.finished_at is None or parent.finished_at > started:
            problems.append(f"{where}: started before its parent {p} finished")
        kids = children.get((run_id, p), [])
        late = [c.key for c in kids if c.finished_at is None or c.finished_at > started or c.state not in _TERMINAL]
        if late:
            problems.append(f"{where}: started before every child of the map {p} was done ({late[0]} was not)")
    return problems


def _check_maps(
    tasks: list[Any],
    by_key: dict[tuple[str, str], Any],
    children: dict[tuple[str, str], list[Any]],
    events: list[Any],
) -> list[str]:
    problems: list[str] = []
    #: the ledger id of each task's last accepted transition to a terminal state
    last_event: dict[tuple[str, str], int] = {}
    for e in events:
        # (an operator's mark of a child already ended changes the map's counts in place, and its
        # outcome only if they say so: the map then has no later close of its own to compare)
        marked = e.actor == "operator" and e.from_state in _TERMINAL
        if e.accepted and e.to_state in _TERMINAL and not marked:
            last_event[(e.run_id, e.key)] = max(last_event.get((e.run_id, e.key), 0), int(e.id))
    for (run_id, header), kids in children.items():
        h = by_key.get((run_id, header))
        if h is None or h.map_spec is None:
            problems.append(f"{run_id}.{header}: {len(kids)} map child(ren) but no mapped node of that key")
            continue
        where = f"{run_id}.{header}"
        indexes = [c.map_index for c in kids]
        if indexes != list(range(len(kids))):
            problems.append(f"{where}: map indexes are not 0..{len(kids) - 1} once each")
        for c in kids:
            if c.key != f"{header}[{c.map_key}]":
                problems.append(f"{run_id}.{c.key}: a child of {header} keyed {c.map_key!r} is not {header}[key]")
        # a map cancelled while its window held back items (or, chained item by item, while the
        # window of the map it follows did): those were never made
        if len(kids) > h.map_total or (len(kids) < h.map_total and h.state != "CANCELLED"):
            problems.append(f"{where}: map_total {h.map_total} but {len(kids)} children")
        if h.state == "PENDING":
            problems.append(f"{where}: PENDING with {len(kids)} children (expanded without becoming MAPPED)")
        if h.state not in _CLOSED:
            continue
        states = Counter(c.state for c in kids)
        ok, failed = states["SUCCEEDED"], states["FAILED"] + states["UPSTREAM_FAILED"]
        skipped = states["SKIPPED"]
        counts = (h.map_done, h.map_ok, h.map_failed, h.map_skipped)
        if counts != (len(kids), ok, failed, skipped):
            problems.append(
                f"{where}: closed {h.state} counting done/ok/failed/skipped {counts}, its children say "
                f"{(len(kids), ok, failed, skipped)} ({dict(states)})"
            )
        decided = "FAILED" if failed else "SKIPPED" if skipped >= len(kids) else "SUCCEEDED"
        if ok + failed + skipped == len(kids) and h.state != decided:
            problems.append(f"{where}: closed {h.state}, its children decide {decided}")
        # by the ledger's order (timestamps are their transactions' starts: the child whose
        # settlement closes the header may have begun before a sibling that committed first)
        closing = last_event.get((run_id, header), 0)
        if h.finished_at is None or any(last_event.get((run_id, c.key), 0) > closing for c in kids):
            problems.append(f"{where}: closed before its last child finished")
    for t in tasks:
        if t.map_spec is not None and (t.run_id, t.key) not in children:
            if t.state == "MAPPED" or t.map_total:
                problems.append(f"{t.run_id}.{t.key}: {t.state} with map_total {t.map_total} but no children")
    return problems
