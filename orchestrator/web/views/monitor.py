"""``/healthz`` (no authentication: it says ``ok`` and nothing else) and ``/metrics``
(Prometheus text, :mod:`orchestrator.web.metrics`)."""

from __future__ import annotations

from ..base import BaseHandler


class Health(BaseHandler):
    def get(self) -> None:
        self.write("ok\n")


class Metrics(BaseHandler):
    page = False  # a scraper: 401, never the login form

    async def get(self) -> None:
        from ..metrics import render as render_metrics

        body, content_type = await self.blocking(render_metrics, self.orc, accept=self.request.headers.get("Accept"))
        self.set_header("Content-Type", content_type)
        self.write(body)
