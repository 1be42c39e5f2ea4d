"""``/api/runs``: the runs list, a run (paged), what changed since a ledger id, and the
run's picture."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from ...core import graph as drawing
from ...core.errors import ValidationError
from ..base import BaseHandler
from ..documents import run_changes, run_document
from ..drawing import run_graph
from ..params import (
    API_LIMIT,
    CHANGES_LIMIT,
    MAX_EVENTS,
    MAX_OFFSET,
    PAGE_SIZE,
    edge_cursor,
    int_arg,
    open_groups,
    opt_int,
    run_filters,
    task_query,
)


class ApiRuns(BaseHandler):
    api = True

    async def get(self) -> None:
        limit = int_arg(self, "limit", PAGE_SIZE, 1, 1000)
        offset = int_arg(self, "offset", 0, 0, MAX_OFFSET)
        views = await self.blocking(self.orc.runs, limit, offset=offset, **run_filters(self))
        self.write({"runs": [v.to_json() for v in views], "limit": limit, "offset": offset})


class ApiRun(BaseHandler):
    """``GET /api/runs/RUN_ID``: the run, paged (see
    :func:`~orchestrator.web.documents.run_document`); ``next`` holds the links to the following
    pages."""

    api = True

    async def get(self, run_id: str) -> None:
        tq = task_query(self, API_LIMIT)
        events = int_arg(self, "events", API_LIMIT, 0, MAX_EVENTS)
        events_before = opt_int(self, "events_before")
        edges_after = edge_cursor(self)
        doc = await self.blocking(
            run_document, self.orc, run_id, tasks=tq, events=events, events_before=events_before,
            edges_after=edges_after,
        )  # fmt: skip
        page = doc["page"]
        base = {**tq.params(API_LIMIT)}
        if events != API_LIMIT:
            base["events"] = str(events)
        here = f"/api/runs/{quote(run_id)}?"

        def link(**cursor: Any) -> str:
            return here + urlencode({**base, **cursor})

        doc["next"] = {
            "tasks": link(after=page["tasks_after"]) if page["tasks_after"] else None,
            "tasks_before": link(before=page["tasks_before"]) if page["tasks_before"] else None,
            "edges": link(edges_after=page["edges_after"]) if page["edges_after"] else None,
            "events": link(events_before=page["events_before"]) if page["events_before"] else None,
            "changes": f"/api/runs/{quote(run_id)}/changes?after={page['last_event']}",
        }
        self.write(doc)


class ApiChanges(BaseHandler):
    """``GET /api/runs/RUN_ID/changes?after=EVENT_ID[&limit=N][&expand=GROUP,...]``: what
    changed since a ledger id (see :func:`~orchestrator.web.documents.run_changes`; ``expand``:
    the task groups the page draws task by task); the run page polls it."""

    api = True

    async def get(self, run_id: str) -> None:
        after = int_arg(self, "after", 0, 0, 2**62)
        limit = int_arg(self, "limit", CHANGES_LIMIT, 1, CHANGES_LIMIT)
        self.write(await self.blocking(run_changes, self.orc, run_id, after, limit, open_groups(self)))


class ApiGraph(BaseHandler):
    """``GET /api/runs/RUN_ID/graph?format=svg|dot|mermaid[&expand=GROUP,...|*]``: the picture,
    each task group folded into one box but those named in ``expand`` (``*``: none folded)."""

    api = True

    async def get(self, run_id: str) -> None:
        fmt = self.get_query_argument("format", "svg")
        if fmt not in drawing.FORMATS:
            raise ValidationError(f"format must be one of {', '.join(drawing.FORMATS)}, not {fmt!r}")
        picture = await self.blocking(run_graph, self.orc, run_id, open_groups(self))
        kinds = {"svg": "image/svg+xml", "dot": "text/vnd.graphviz", "mermaid": "text/plain"}
        self.set_header("Content-Type", f"{kinds[fmt]}; charset=utf-8")
        self.write(drawing.FORMATS[fmt](picture))
