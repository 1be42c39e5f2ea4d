"""Any other address: 404, after authentication and with the security headers."""

from __future__ import annotations

import tornado.web

from ..base import BaseHandler


class NotFound(BaseHandler):
    """Any other address: 404 (after authentication, with the security headers)."""

    async def prepare(self) -> None:
        self.api = self.request.path.startswith("/api/")  # an address under /api answers JSON
        await super().prepare()
        if not self._finished:
            raise tornado.web.HTTPError(404)
