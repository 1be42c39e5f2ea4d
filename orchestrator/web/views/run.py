"""``/runs/RUN_ID``: the run page, its drawing alone (``?part=dag``, with ``&expand=`` the task
groups drawn task by task: a folded group's box clicked), a map's children drawn
(``?part=map&key=KEY``), its script (``/static/run.js``), and its forms' actions (POST, then back
to the page with a one-time banner)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from ...core import graph as drawing
from ...core.dag import KEY_RE
from ...core.errors import ValidationError
from ...core.states import RunState, TaskState
from ..actions import MARKS, ActionHandler
from ..base import BaseHandler, render
from ..documents import run_page_data
from ..drawing import map_svg, run_dag_svg
from ..params import LEDGER_ROWS, TASK_ROWS, open_groups, opt_int, task_query

#: the run page's script (served at /static/run.js)
RUN_SCRIPT = Path(__file__).parent.parent / "static" / "run.js"


def _flash(signed: bytes | None) -> dict[str, Any]:
    """The one-time banner an action left (its signed cookie): ``text``, and ``from``, the run a
    rerun repeats (``None`` otherwise). Nothing, or anything unreadable: no banner."""
    empty: dict[str, Any] = {"text": "", "from": None}
    if not signed:
        return empty
    try:
        found = json.loads(signed.decode())
    except (UnicodeDecodeError, ValueError):
        return empty
    if not isinstance(found, dict) or not isinstance(found.get("text"), str):
        return empty
    origin = found.get("from")
    return {"text": found["text"], "from": origin if isinstance(origin, str) else None}


class RunPage(BaseHandler):
    async def get(self, run_id: str) -> None:
        if self.get_query_argument("part", "") == "dag":  # the drawing alone (a large run's page fetches it)
            svg = await self.blocking(run_dag_svg, self.orc, run_id, open_groups(self))
            self.set_header("Content-Type", "image/svg+xml; charset=UTF-8")
            self.write(svg)
            return
        if self.get_query_argument("part", "") == "map":  # a map's children drawn (its box expanded)
            key = self.get_query_argument("key", "")
            if not KEY_RE.fullmatch(key):
                raise ValidationError("key must be a mapped task's key")
            svg = await self.blocking(map_svg, self.orc, run_id, key)
            self.set_header("Content-Type", "image/svg+xml; charset=UTF-8")
            self.write(svg)
            return
        tq = task_query(self, TASK_ROWS)
        events_before = opt_int(self, "events_before")
        doc, svg = await self.blocking(run_page_data, self.orc, run_id, tq, events_before)
        flash = self.get_signed_cookie("orc_done", max_age_days=1)
        if flash is not None:
            self.clear_cookie("orc_done")
        done = _flash(flash)
        here = f"/runs/{quote(run_id)}?"
        filters = tq.params(TASK_ROWS)
        page = doc["page"]

        def tasks_link(**cursor: str) -> str:
            return here + urlencode({**filters, **cursor}) + "#tasks"

        self.write(
            render(
                "run.html",
                title=f"Run {run_id}",
                handler=self,
                doc=doc,
                svg=svg,
                final=RunState(doc["run"]["state"]).terminal,
                colours=drawing.COLOURS,
                done=done["text"],
                done_from=done["from"],
                ledger_rows=LEDGER_ROWS,
                task_rows=TASK_ROWS,
                query=tq,
                task_states=list(TaskState),
                marks=[(word, state.value) for word, state in MARKS.items()],
                links={
                    "first": tasks_link() if tq.after or tq.before else None,
                    "next": tasks_link(after=page["tasks_after"]) if page["tasks_after"] else None,
                    "prev": tasks_link(before=page["tasks_before"]) if page["tasks_before"] else None,
                    "older": here + urlencode({**filters, "events_before": page["events_before"]}) + "#ledger"
                    if page["events_before"]
                    else None,
                    "newest": here + urlencode(filters) + "#ledger" if events_before is not None else None,
                },
            )
        )


class RunAction(ActionHandler):
    async def post(self, run_id: str, key: str | None = None, action: str = "cancel") -> None:
        done = await self.act(run_id, key, action)
        # the outcome travels in a signed one-time cookie: a link cannot put words in the banner;
        # a rerun's banner links back to the run it repeats
        flash = {"text": done.text, "from": run_id if done.run_id != run_id else None}
        self.set_signed_cookie(
            "orc_done", json.dumps(flash), expires_days=None, httponly=True, samesite="Strict",
            secure=self.secure_cookies,
        )  # fmt: skip
        self.redirect(f"/runs/{quote(done.run_id)}", status=303)


class RunScript(BaseHandler):
    """``/static/run.js``: the run page's script (a file of this origin, as the CSP wants)."""

    page = False

    def get(self) -> None:
        self.set_header("Content-Type", "text/javascript; charset=utf-8")
        self.write(RUN_SCRIPT.read_bytes())
