"""The model test's checks (``tests/store/test_model.py``): what must hold after every step of
the state machine, read from the database and the kit's in-process broker.

- :func:`counter_problems`: a PENDING task's trigger-rule counters (``n_upstream`` ..
  ``n_setup_skipped``) equal a recount from its parents' rows (the recount of
  ``orc_redecide_v2``: an expanded map counts as its children, a chained map's child has its item
  as its parent, another map's child none), a MAPPED header's ``map_done`` .. ``map_skipped``
  its children's, and a run's ``open_tasks`` its open rows;
- :func:`revoked_problems`: no QUEUED or RUNNING task whose current message id (the last one
  published for its attempt) was revoked (a worker drops such a message, and its re-publish
  is dropped again: the task never runs);
- :func:`progress_problems`: every open run has a next step some actor will take: a task
  READY (the dispatcher), QUEUED with a message a worker will take or the reconciler re-publish,
  RUNNING (its worker, or its lease's expiry), RETRYING (the reconciler), WAITING on something
  named (an event, an instant, an approval), DEAD_LETTER (a person, flagged), a PENDING one whose
  upstream is still open, a MAPPED header with an open child.

One accepted outcome per task generation is :func:`orchestrator.services.invariants.check_runs`'s.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from orchestrator.store import schema as s
from orchestrator.testing import InProcessPublisher

TERMINAL = {"SUCCEEDED", "FAILED", "UPSTREAM_FAILED", "SKIPPED", "CANCELLED"}
#: the states a parent counts as done in its children's counters (a cancel settles nothing)
DONE = {"SUCCEEDED", "FAILED", "UPSTREAM_FAILED", "SKIPPED"}
COUNTERS = ("n_upstream", "n_done", "n_succeeded", "n_failed", "n_upstream_failed", "n_skipped",
            "n_setup_ok", "n_setup_skipped")  # fmt: skip


def rows(engine: sa.engine.Engine, run_ids: Iterable[str]) -> tuple[list[Any], list[Any], list[Any]]:
    """(tasks, edges, runs) of the runs."""
    ids = list(run_ids)
    t, e, r = s.tasks.c, s.edges.c, s.runs.c
    with engine.connect() as conn:
        tasks = list(conn.execute(sa.select(s.tasks).where(t.run_id.in_(ids))).all())
        edges = list(conn.execute(sa.select(s.edges).where(e.run_id.in_(ids))).all())
        runs = list(conn.execute(sa.select(s.runs).where(r.id.in_(ids))).all())
    return tasks, edges, runs


def _expanded(p: Any) -> bool:
    return p.map_spec is not None and p.map_total > 0 and p.state != "PENDING"


def counter_problems(tasks: list[Any], edges: list[Any], runs: list[Any]) -> list[str]:
    problems: list[str] = []
    by_key = {(x.run_id, x.key): x for x in tasks}
    kids: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for x in tasks:
        if x.map_parent is not None:
            kids[(x.run_id, x.map_parent)].append(x)
    parents: dict[tuple[str, str], list[str]] = defaultdict(list)
    for e in edges:
        parents[(e.run_id, e.child_key)].append(e.parent_key)
    running = {r.id for r in runs if r.state == "RUNNING"}
    for x in tasks:
        if x.run_id not in running:
            continue
        where = f"{x.run_id}.{x.key}"
        if x.state == "PENDING":
            ps = parents[(x.run_id, x.key)] if x.map_parent is None else []
            if x.map_item_from is not None:
                ps = [*ps, x.map_item_from]
            n = 0
            units: list[tuple[str, bool]] = []
            for pk in ps:
                p = by_key.get((x.run_id, pk))
                if p is None:
                    problems.append(f"{where}: parent {pk} has no row")
                    continue
                if _expanded(p):
                    n += p.map_total
                    units += [(c.state, False) for c in kids[(x.run_id, pk)]]
                else:
                    n += 1
                    units.append((p.state, p.role == "setup"))
            states = Counter(st for st, _ in units)
            want = {
                "n_upstream": n,
                "n_done": sum(states[st] for st in DONE),
                "n_succeeded": states["SUCCEEDED"],
                "n_failed": states["FAILED"],
                "n_upstream_failed": states["UPSTREAM_FAILED"],
                "n_skipped": states["SKIPPED"],
                "n_setup_ok": sum(1 for st, setup in units if setup and st == "SUCCEEDED"),
                "n_setup_skipped": sum(1 for st, setup in units if setup and st == "SKIPPED"),
            }
            have = {c: getattr(x, c) for c in COUNTERS}
            if have != want:
                diff = {c: (have[c], want[c]) for c in COUNTERS if have[c] != want[c]}
                problems.append(f"{where}: PENDING counters (row, recount) {diff}")
        if x.state == "MAPPED":
            children = kids[(x.run_id, x.key)]
            states = Counter(c.state for c in children)
            want_map = (
                sum(states[st] for st in DONE),
                states["SUCCEEDED"],
                states["FAILED"] + states["UPSTREAM_FAILED"],
                states["SKIPPED"],
            )
            have_map = (x.map_done, x.map_ok, x.map_failed, x.map_skipped)
            if have_map != want_map:
                problems.append(
                    f"{where}: MAPPED counts done/ok/failed/skipped {have_map}, its children say {want_map}"
                )
    open_rows = Counter(x.run_id for x in tasks if x.state not in TERMINAL)
    for r in runs:
        if r.open_tasks != open_rows[r.id]:
            problems.append(f"run {r.id} ({r.state}): open_tasks {r.open_tasks}, {open_rows[r.id]} open rows")
    return problems


def current_message(publisher: InProcessPublisher) -> dict[tuple[str, str, int], str]:
    """(run, key, attempt) -> the id of the last message published for it."""
    out: dict[tuple[str, str, int], str] = {}
    for d in publisher.sent:
        out[(d.run_id, d.key, d.attempt)] = d.token.task_id
    return out


def revoked_problems(tasks: list[Any], publisher: InProcessPublisher) -> list[str]:
    problems: list[str] = []
    current = current_message(publisher)
    for x in tasks:
        if x.state not in ("QUEUED", "RUNNING"):
            continue
        message = current.get((x.run_id, x.key, x.attempt))
        if message is None:
            # admitted and never published: the reconciler's re-publish is its next step
            continue
        if message in publisher.revoked:
            problems.append(
                f"{x.run_id}.{x.key}: {x.state} at attempt {x.attempt}, its message {message} was revoked"
                " (a worker drops it, and every re-publish of it)"
            )
    return problems


def progress_problems(tasks: list[Any], edges: list[Any], runs: list[Any]) -> list[str]:
    problems: list[str] = []
    by_key = {(x.run_id, x.key): x for x in tasks}
    kids: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for x in tasks:
        if x.map_parent is not None:
            kids[(x.run_id, x.map_parent)].append(x)
    parents: dict[tuple[str, str], list[str]] = defaultdict(list)
    for e in edges:
        parents[(e.run_id, e.child_key)].append(e.parent_key)
    by_run: dict[str, list[Any]] = defaultdict(list)
    for x in tasks:
        by_run[x.run_id].append(x)

    def unit_open(run_id: str, key: str) -> bool:
        p = by_key.get((run_id, key))
        if p is None:
            return False
        if p.state not in TERMINAL:
            return True
        return any(c.state not in TERMINAL for c in kids[(run_id, key)])

    for r in runs:
        if r.state != "RUNNING":
            continue
        moving = []
        for x in by_run[r.id]:
            where = f"{r.id}.{x.key}"
            if x.state in ("READY", "QUEUED", "RUNNING", "DEAD_LETTER"):
                moving.append(x.key)
            elif x.state == "RETRYING":
                if x.not_before is None:
                    problems.append(f"{where}: RETRYING with no not_before (no reconciler pass releases it)")
                moving.append(x.key)
            elif x.state == "WAITING":
                kind = (x.waiting or {}).get("kind")
                if x.wake_at is None and x.wait_event is None and kind != "approval":
                    problems.append(f"{where}: WAITING on nothing named ({x.waiting})")
                moving.append(x.key)
            elif x.state == "MAPPED":
                children = kids[(r.id, x.key)]
                if not any(c.state not in TERMINAL for c in children) and x.map_done >= x.map_total:
                    problems.append(f"{where}: MAPPED with every one of its {len(children)} children done")
            elif x.state == "PENDING":
                if x.map_parent is not None and x.map_item_from is None:
                    siblings = [c for c in kids[(r.id, x.map_parent)] if c.key != x.key]
                    if not any(c.state not in TERMINAL and c.state != "PENDING" for c in siblings):
                        problems.append(f"{where}: a PENDING child of {x.map_parent} with no sibling to finish")
                    continue
                # a task with a setup scope also waits for those setups (their finish decides it)
                ups = [*parents[(r.id, x.key)], *([x.map_item_from] if x.map_item_from else []),
                       *(x.setup_scope or [])]  # fmt: skip
                if not any(unit_open(r.id, u) for u in ups):
                    problems.append(f"{where}: PENDING ({x.trigger_rule}) with every upstream done: {ups}")
        if not moving:
            states = sorted({x.state for x in by_run[r.id]})
            problems.append(f"run {r.id}: RUNNING with no task any actor will move (states {states})")
    return problems
