"""``POST /api/bulk/cancel|retry|rerun``: a bulk action (:mod:`orchestrator.web.bulk`) answered
as JSON: the filter, the counts and one entry per selected run (``outcome``: ``planned`` with
``dry_run=1``, ``done``, ``skipped`` with the reason, or ``failed`` with the refusal)."""

from __future__ import annotations

from ..bulk import BulkHandler


class ApiBulk(BulkHandler):
    api = True

    async def post(self, action: str) -> None:
        report = await self.bulk(action)
        self.write({"ok": True, **report.to_json()})
