"""Alerts for tasks parked in DEAD_LETTER and for schedules that could not fire: a log line, a
Celery signal and an optional webhook.

Connect to :data:`task_dead_lettered` or :data:`schedule_failed` (``sender`` is the actor,
keyword ``alert`` the payload; a schedule's payload has ``"event": "schedule_failed"``) or set
``ORCHESTRATOR_ALERT_WEBHOOK`` to receive a JSON POST per alert.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from celery.utils.dispatch import Signal

from . import redact

log = logging.getLogger(__name__)

task_dead_lettered = Signal(name="task_dead_lettered", providing_args={"alert"})
schedule_failed = Signal(name="schedule_failed", providing_args={"alert"})


def raise_alert(alert: dict[str, Any], *, webhook: str | None, actor: str, timeout: float = 5.0) -> None:
    """Deliver ``alert`` everywhere it is wanted; a failing receiver never fails the caller."""
    scheduled = alert.get("event") == "schedule_failed"
    what, signal = (
        ("schedule could not fire", schedule_failed) if scheduled else ("task dead-lettered", task_dead_lettered)
    )
    log.error("%s, needs attention: %s", what, json.dumps(alert, sort_keys=True, default=str))
    try:
        signal.send(sender=actor, alert=alert)
    except Exception:
        log.exception("a %s receiver failed", signal.name)
    if not webhook:
        return
    request = urllib.request.Request(
        webhook,
        data=json.dumps(alert).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except Exception as exc:  # noqa: BLE001 - a failing receiver never fails the caller
        # no traceback and no full URL: a webhook's URL is its secret
        log.error("alert webhook %s failed: %s", redact.webhook(webhook), type(exc).__name__)
