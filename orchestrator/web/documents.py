"""The run as documents: the JSON of ``/api/runs/RUN_ID`` (paged), what the run page
renders, and what changed since a ledger id (``/api/runs/RUN_ID/changes``, polled by the page).
Built off the IO loop (each reads the database)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core import graph as drawing
from ..core.states import TaskState
from .drawing import DEFER_DRAWING_ABOVE, SKELETON_CACHE, run_dag_svg, run_drawing
from .params import API_LIMIT, EDGE_SEPARATOR, LEDGER_ROWS, TaskQuery

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator


#: the most running tasks whose progress a poll of the run page answers
PROGRESS_ROWS = 200


def _event_json(event_id: int, event: Any) -> dict[str, Any]:
    return {"id": event_id, **event.to_json()}


def _waiting(orc: Orchestrator, run_id: str, tasks: list[Any]) -> dict[str, Any]:
    """Why each waiting task of ``tasks`` (not final, not running) waits."""
    keys = {t.key for t in tasks if not t.state.terminal and t.state is not TaskState.RUNNING}
    if not keys:
        return {}
    return {e.key: [r.to_json() for r in e.reasons] for e in orc.explain(run_id, keys=keys)}


def run_document(
    orc: Orchestrator,
    run_id: str,
    *,
    tasks: TaskQuery | None = None,
    events: int = API_LIMIT,
    events_before: int | None = None,
    edges_after: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A run as JSON, paged: the run (with its tasks counted per state), one page of its tasks
    (``tasks``; the first :data:`~.params.API_LIMIT` keys by default) and why the waiting ones
    wait, as many of its edges, and ``events`` ledger rows (the newest, or those before the id
    ``events_before``), oldest first. ``page`` holds the cursors of the next pages."""
    reads = orc.reads
    tq = tasks or TaskQuery(API_LIMIT)
    view = orc.visible(run_id)
    page = reads.task_page(run_id, limit=tq.limit, after=tq.after, before=tq.before, state=tq.state, search=tq.search)
    edges, more_edges = reads.edge_page(run_id, limit=tq.limit, after=edges_after)
    ledger, older = reads.event_page(run_id, limit=events, before=events_before) if events else ([], False)
    if events_before is None and ledger:
        newest = ledger[-1][0]
    else:
        found, _ = reads.event_page(run_id, limit=1)
        newest = found[-1][0] if found else 0
    progress = reads.progress(run_id, [t.key for t in page.tasks])
    return {
        "run": view.to_json(),
        "counts": dict(sorted(view.counts.items())),
        "tasks": [t.to_json() | {"progress": p.to_json() if (p := progress.get(t.key)) else None} for t in page.tasks],
        "edges": [list(e) for e in edges],
        "waiting": _waiting(orc, run_id, page.tasks),
        "events": [_event_json(i, e) for i, e in ledger],
        "page": {
            "limit": tq.limit,
            "tasks_after": page.tasks[-1].key if page.tasks and page.more_after else None,
            "tasks_before": page.tasks[0].key if page.tasks and page.more_before else None,
            "edges_after": EDGE_SEPARATOR.join(edges[-1]) if edges and more_edges else None,
            "events_before": ledger[0][0] if ledger and older else None,
            #: the run's newest ledger id: what changes after it, /api/runs/RUN_ID/changes?after=
            "last_event": newest,
        },
    }


def run_page_data(
    orc: Orchestrator, run_id: str, tasks: TaskQuery, events_before: int | None
) -> tuple[dict[str, Any], str | None]:
    """The run page's document (one page of tasks, one of the ledger) and its SVG, built off
    the IO loop. The SVG is ``None`` when the run's skeleton is not kept yet and the run is
    large: laying out tens of thousands of tasks takes most of a second, so the page is served
    without it and its script fetches the drawing (``?part=dag``, :func:`~.drawing.run_dag_svg`)."""
    doc = run_document(orc, run_id, tasks=tasks, events=LEDGER_ROWS, events_before=events_before)
    doc.pop("edges")
    doc["lineage"] = orc.children.lineage(run_id)  # a child run's parent, a parent's child runs: links each way
    if sum(doc["counts"].values()) > DEFER_DRAWING_ABOVE and not SKELETON_CACHE.knows(run_id):
        return doc, None
    return doc, run_dag_svg(orc, run_id)


def run_changes(
    orc: Orchestrator, run_id: str, after: int, limit: int, open_groups: tuple[str, ...] | None = ()
) -> dict[str, Any]:
    """What changed in the run since the ledger id ``after``: at most ``limit`` new ledger rows
    (oldest first; ``more``: others wait, ask again from ``last``), the current state of every
    task they name, the run's state and counts per state, the counts of the collapsed boxes of
    the drawing those tasks are in (the drawing with ``open_groups`` open, as the page drew it),
    and what the running tasks' bodies last reported (``progress``: a report writes no ledger
    row, so it is answered whole on every poll)."""
    reads = orc.reads
    ledger, more = reads.event_page(run_id, limit=limit, after=after)
    view = orc.visible(run_id)
    keys = sorted({e.key for _, e in ledger if e.key is not None})
    tasks = reads.tasks_by_key(run_id, keys) if keys else []
    progress = reads.progress(run_id, running=True, limit=PROGRESS_ROWS) | reads.progress(run_id, keys)
    boxes: dict[str, Any] = {}
    skeleton = None
    if keys:
        skeleton, picture = run_drawing(orc, run_id, open_groups)
        # a map's child has no box: its map's box counts it
        touched = {skeleton.box_of.get(t.map_parent or t.key) for t in tasks}
        boxes = {
            b.id: {"state": b.state, "counts": b.counts, "title": drawing.counted(b)}
            | ({"label": drawing.map_label(b), "sub": drawing.map_sub(b), "key": b.keys[0]} if b.mapped else {})
            for b in picture.boxes
            if (b.collapsed or b.mapped) and b.id in touched
        }
    return {
        "run": {"id": view.id, "state": view.state.value, "final": view.state.terminal},
        "counts": dict(sorted(view.counts.items())),
        "events": [_event_json(i, e) for i, e in ledger],
        "tasks": {
            t.key: {
                "state": t.state.value,
                "attempt": t.attempt,
                "max_attempts": t.max_attempts,
                "worker": t.worker,
                "duration": t.duration,
                "error": t.error[:300] if t.error and t.state is not TaskState.SUCCEEDED else None,
                "box": skeleton.box_of.get(t.map_parent or t.key) if skeleton else None,
                "skip_reason": t.skip_reason,
                "map": t.map_counts,
                "waiting": t.waiting,
            }
            for t in tasks
        },
        "boxes": boxes,
        #: what the running tasks' bodies last reported (update_state), the freshest first, and
        #: the last reports of the tasks that changed (a body's last report comes just before its end)
        "progress": {k: p.to_json() for k, p in progress.items()},
        "last": ledger[-1][0] if ledger else after,
        "more": more,
    }
