"""The promise, checked from the database alone (fault tests and the chaos soak use this).

:func:`check_runs` returns one line per violation; an empty list means the runs kept every
invariant of ARCHITECTURE.md section 2 that the database can show.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from .states import ANNOTATIONS, RUN_TRANSITIONS, TERMINAL, TRANSITIONS, RunState, TaskState
from .store import Store

_OUTCOMES = {"SUCCEEDED", "FAILED", "RETRYING", "DEAD_LETTER"}


def check_runs(
    store: Store, run_ids: Iterable[str], *, allow_dead_letter: bool = False, in_progress_ok: bool = False
) -> list[str]:
    """Violations across ``run_ids``:

    - every task terminal (DEAD_LETTER too when ``allow_dead_letter``), every run final
      (``in_progress_ok``: a run still RUNNING may have open tasks: ``orchestrator verify``);
    - at most one accepted SUCCEEDED per task, exactly one for a SUCCEEDED task, and its
      attempt is the row's attempt;
    - every execution recorded in ``orc_probe_effects`` beyond the first of an attempt is
      matched by an outcome event (accepted or rejected) of that attempt;
    - parents finished before their children started;
    - only legal transitions were accepted (tasks and runs), and attempts never went backwards;
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
    tasks, runs, edges, effects = snap.tasks, snap.runs, snap.edges, snap.effects
    problems.extend(_check_annotations([e for e in snap.events if _kind(e) is not None]))
    transitions = [e for e in snap.events if _kind(e) is None]
    events = [e for e in transitions if e.key is not None]
    run_events = [e for e in transitions if e.key is None]
    allowed = {st.value for st in TERMINAL} | ({TaskState.DEAD_LETTER.value} if allow_dead_letter else set())
    by_key = {(t.run_id, t.key): t for t in tasks}
    running = {r.id for r in runs if r.state == "RUNNING"} if in_progress_ok else set()
    for t in tasks:
        if t.state not in allowed and t.run_id not in running:
            problems.append(f"{t.run_id}.{t.key}: stuck in {t.state} (attempt {t.attempt})")
    if not allow_dead_letter and not in_progress_ok:
        problems.extend(f"run {r.id}: not final ({r.state})" for r in runs if r.state == "RUNNING")

    accepted_success: Counter[tuple[str, str]] = Counter()
    outcome_events: Counter[tuple[str, str, int]] = Counter()
    last_attempt: dict[tuple[str, str], int] = {}
    for e in events:
        k = (e.run_id, e.key)
        if e.from_state == "RUNNING" or e.to_state in _OUTCOMES:
            outcome_events[(e.run_id, e.key, e.attempt)] += 1
        if not e.accepted:
            continue
        if e.to_state == "SUCCEEDED":
            accepted_success[k] += 1
            row = by_key.get(k)
            if row is not None and row.attempt != e.attempt:
                problems.append(f"{e.run_id}.{e.key}: success accepted for attempt {e.attempt}, row at {row.attempt}")
        if e.from_state is not None:
            legal = TRANSITIONS.get((TaskState(e.from_state), TaskState(e.to_state)))
            if legal is None or e.actor not in legal:
                problems.append(f"{e.run_id}.{e.key}: illegal {e.from_state} -> {e.to_state} by {e.actor}")
        if e.attempt < last_attempt.get(k, 0):
            problems.append(f"{e.run_id}.{e.key}: attempt went back from {last_attempt[k]} to {e.attempt}")
        last_attempt[k] = max(last_attempt.get(k, 0), e.attempt)
    for k, n in accepted_success.items():
        if n > 1:
            problems.append(f"{k[0]}.{k[1]}: {n} accepted results (committed twice)")
    for t in tasks:
        if t.state == "SUCCEEDED" and accepted_success[(t.run_id, t.key)] != 1:
            problems.append(f"{t.run_id}.{t.key}: SUCCEEDED without exactly one accepted result")

    for run_id, key, attempt, n in effects:
        if n > 1 and outcome_events[(run_id, key, attempt)] < n:
            problems.append(
                f"{run_id}.{key} attempt {attempt}: {n} executions but {outcome_events[(run_id, key, attempt)]}"
                " outcome events (an extra execution left no record)"
            )

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

    parents: dict[tuple[str, str], list[str]] = defaultdict(list)
    for e in edges:
        parents[(e.run_id, e.child_key)].append(e.parent_key)
    for (run_id, child), ps in parents.items():
        c = by_key.get((run_id, child))
        if c is None or c.started_at is None:
            continue
        for p in ps:
            parent = by_key[(run_id, p)]
            if parent.finished_at is None or parent.finished_at > c.started_at:
                problems.append(f"{run_id}.{child}: started before its parent {p} finished")
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
        if e.accepted:
            seen[(e.run_id, e.key, kind)] += 1
    for (run_id, key, kind), n in seen.items():
        if n > 1:
            where = f"{run_id}.{key}" if key is not None else f"run {run_id}"
            problems.append(f"{where}: {kind} recorded {n} times")
    return problems
