"""``POST /api/events``: emit an event (what waiting tasks wait for)."""

from __future__ import annotations

import tornado.web

from ...core.dag import parse_spec
from ...core.errors import (
    SpecError,
    ValidationError,
)
from ..base import BaseHandler


class ApiEvents(BaseHandler):
    """``POST /api/events`` with a JSON body ``{"key", "payload", "event_id"}``: emit an event
    as the credential's tenant (a credential bound to a tenant emits for it only; one for every
    tenant may name ``"tenant"``, else ``default``). Answers ``{"ok": true, "id", "event_id",
    "duplicate", "woken"}``, or ``{"error"}`` with 400 (bad input), 403 (another tenant) or 409
    (an ``event_id`` reused with another key or payload: ``EventIdConflict``)."""

    api = True

    async def post(self) -> None:
        self.require_write()
        orc = self.orc
        body = self.request.body or b""
        if len(body) > 2 * orc.settings.max_event_bytes + 4096:
            raise tornado.web.HTTPError(413, reason="event body too large (ORCHESTRATOR_MAX_EVENT_BYTES)")
        try:
            # parse_spec: no NaN, no duplicate key, and nesting too deep is a refusal (never a
            # RecursionError); the payload is then held to MAX_JSON_DEPTH by emit
            doc = parse_spec(body.decode("utf-8") or "null", fmt="json")
        except (UnicodeDecodeError, SpecError) as exc:
            why = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise ValidationError(f"the body must be a JSON object {{key, payload, event_id}} ({why})") from None
        if not isinstance(doc, dict):
            raise ValidationError("the body must be a JSON object {key, payload, event_id}")
        unknown = set(doc) - {"key", "payload", "event_id", "tenant"}
        if unknown:
            raise ValidationError(f"unknown field(s) {sorted(unknown)}; an event has key, payload, event_id")
        tenant = doc.get("tenant")
        cred = self.current_user
        if tenant is not None and cred is not None and cred.tenant is not None and tenant != cred.tenant:
            raise tornado.web.HTTPError(403, reason=f"this credential emits for tenant {cred.tenant!r} only")
        done = await self.blocking(
            orc.events.emit,
            doc.get("key"),
            doc.get("payload"),
            event_id=doc.get("event_id"),
            tenant=tenant,
            by=self.by(),
        )
        self.write(
            {"ok": True, "id": done.id, "event_id": done.event_id, "duplicate": done.duplicate, "woken": done.woken}
        )
