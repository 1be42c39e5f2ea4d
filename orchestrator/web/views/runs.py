"""``/runs``: runs with filters (``tenant``, ``dag``, ``state``) and paging (``page``); ``/``
goes there."""

from __future__ import annotations

from urllib.parse import urlencode

from ...core.states import RunState
from ..base import BaseHandler, render
from ..params import MAX_OFFSET, PAGE_SIZE, int_arg, run_filters


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
            return "/runs?" + urlencode({**{k: v for k, v in filters.items() if v}, "page": p})

        self.write(
            render(
                "runs.html",
                title="Runs",
                handler=self,
                runs=views[:PAGE_SIZE],
                filters=filters,
                states=list(RunState),
                page=page,
                prev=link(page - 1) if page > 1 else None,
                next=link(page + 1) if more else None,
            )
        )
