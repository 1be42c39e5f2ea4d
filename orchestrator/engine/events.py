"""``orc.events``: events from outside (``emit``) and signals to one run (``signal``), which wake
the tasks WAITING for them (stored by :mod:`orchestrator.store.waits`); an event also fires the
event triggers that match it."""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..core.dag import check_json, text_problem
from ..core.errors import ValidationError
from ..core.waits import check_event_key
from ..store.waits import Emitted
from .scope import Host, acting_tenant

#: the longest event id (``emit(..., event_id=...)``)
MAX_EVENT_ID_CHARS = 200


class Events:
    """The events API of one :class:`~orchestrator.engine.Orchestrator` (``orc.events``)."""

    def __init__(self, orc: Host) -> None:
        self.orc = orc

    def emit(
        self,
        key: str,
        payload: dict[str, Any] | None = None,
        *,
        event_id: str | None = None,
        tenant: str | None = None,
        by: str | None = None,
    ) -> Emitted:
        """Emit the event ``key`` with a JSON object ``payload`` for ``tenant`` (a bound
        orchestrator: its own; else ``tenant`` or ``default``): written once per ``event_id``
        (a second emit of the same id, key and payload is ignored: ``duplicate``), and every task
        of the tenant WAITING for that key whose match the payload contains is woken in the
        same transaction; what they made READY is published after it. Raises
        :class:`ValidationError` (nothing written) for a bad key, payload or event id,
        :class:`EmitTimeout` past ``ORCHESTRATOR_EMIT_TIMEOUT_SECONDS``, :class:`EventIdConflict`
        for an ``event_id`` the tenant used with another key or payload."""
        check_event_key(key)
        orc = self.orc
        owner = acting_tenant(orc.tenant, tenant, "emit")
        body = self._payload(payload, "event")
        done = orc.store.waits.emit(
            owner, key, body, self._event_id(event_id), None, by, orc.settings.dispatch_window,
            orc.settings.emit_timeout_seconds,
        )  # fmt: skip
        orc.publisher.publish(done.dispatches)
        if not done.duplicate:  # the event triggers' runs (any beat finishes what this leaves)
            orc.triggers.finish(done.id)
        return done

    def signal(
        self, run_id: str, name: str, payload: dict[str, Any] | None = None, *, event_id: str | None = None,
        by: str | None = None,
    ) -> Emitted:  # fmt: skip
        """Send the signal ``name`` to one run: its tasks WAITING for ``name`` (a wait node's
        ``event=``, a ``Defer(event=...)``) whose match the payload contains are woken; a task of
        the run that begins to wait for it later finds it (the lookback). Raises
        :class:`RunNotFound` (another tenant's run too) or :class:`ValidationError`."""
        check_event_key(name, what="signal")
        orc = self.orc
        body = self._payload(payload, "signal")
        view = orc.visible(run_id)
        done = orc.store.waits.emit(
            view.tenant, name, body, self._event_id(event_id), run_id, by, orc.settings.dispatch_window,
            orc.settings.emit_timeout_seconds,
        )  # fmt: skip
        orc.publisher.publish(done.dispatches)
        return done

    def _payload(self, payload: Any, what: str) -> str:
        """``payload`` as JSON text, checked: plain JSON, an object (or None: ``{}``), at most
        ORCHESTRATOR_MAX_EVENT_BYTES."""
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise ValidationError(f"{what} payload must be a JSON object, not {type(payload).__name__}")
        check_json(payload, f"{what} payload")
        body = json.dumps(payload)
        most = self.orc.settings.max_event_bytes
        if len(body.encode()) > most:
            raise ValidationError(f"{what} payload exceeds {most} bytes of JSON (ORCHESTRATOR_MAX_EVENT_BYTES)")
        return body

    @staticmethod
    def _event_id(event_id: Any) -> str:
        if event_id is None:
            return uuid.uuid4().hex
        problem = text_problem(event_id, MAX_EVENT_ID_CHARS) if isinstance(event_id, str) else "must be a string"
        if problem:
            raise ValidationError(f"event_id {problem}")
        return str(event_id)
