"""``/runs``: runs with filters (``tenant``, ``dag``, ``state``, ``tag=KEY=VALUE``) and paging
(``page``), and its bulk actions' form (``POST /bulk/cancel|retry|rerun``: a dry run's preview
with a form to apply it, then what was done); ``/`` goes there."""

from __future__ import annotations

from urllib.parse import urlencode

from ...core.states import RunState
from ...engine.bulk import BULK_ACTIONS
from ..base import BaseHandler, render
from ..bulk import BulkHandler
from ..params import MAX_OFFSET, PAGE_SIZE, filter_query, int_arg, run_filters


class Home(BaseHandler):
    def get(self) -> None:
        self.redirect("/runs")


class RunsPage(BaseHandler):
    async def get(self) -> None:
        filters = run_filters(self)
        page = int_arg(self, "page", 1, 1, MAX_OFFSET // PAGE_SIZE)
        views = await self.blocking(self.orc.runs, PAGE_SIZE + 1, offset=(page - 1) * PAGE_SIZE, **filters)
        more = len(views) > PAGE_SIZE

        def link(p: int) -> str:
            return "/runs?" + urlencode([*filter_query(filters), ("page", str(p))])

        self.write(
            render(
                "runs.html",
                title="Runs",
                handler=self,
                runs=views[:PAGE_SIZE],
                filters=filters,
                states=list(RunState),
                actions=BULK_ACTIONS,
                page=page,
                prev=link(page - 1) if page > 1 else None,
                next=link(page + 1) if more else None,
            )
        )


class BulkPage(BulkHandler):
    """``POST /bulk/ACTION`` from the runs list: with ``dry_run=1`` the runs it would change (and a
    form that applies it to the same filter), else what it did, run by run."""

    async def post(self, action: str) -> None:
        report = await self.bulk(action)
        doc = report.to_json()
        back = "/runs?" + urlencode(filter_query(doc["filter"]))
        self.write(render("bulk.html", title=f"Bulk {action}", handler=self, report=report, r=doc, back=back))
