"""Alerts for tasks parked in DEAD_LETTER, for schedules that could not fire, for missed
deadlines, for circuit breakers that changed state and for tasks the reconciler's watchdog found
stuck: a log line, a Celery signal and an optional webhook.

Connect to :data:`task_dead_lettered`, :data:`schedule_failed` or :data:`deadline_missed`
(``sender`` is the actor, keyword ``alert`` the payload; a schedule's payload has
``"event": "schedule_failed"``, a missed deadline's ``"event": "deadline_missed"`` with
``run_id``, ``dag``, ``tenant``, ``key`` (``None`` for the run's own deadline),
``deadline_seconds``, ``due_at``, ``missed_at``, ``state``, ``on_deadline`` and ``reason``; a
breaker's ``"event": "breaker_changed"`` with ``breaker``, ``from_state``, ``state``, ``actor``,
``by``, ``reason`` and ``at``; connect to :data:`breaker_changed`; a task the watchdog flagged,
``"event": "task_stuck"`` with ``run_id``, ``key`` (``None`` for an idle run), ``attempt``,
``state``, ``kind`` (``unregistered``, ``republished`` or ``idle``), ``detail``, ``tenant``,
``dag``, ``task_name`` and ``queue``; connect to :data:`task_stuck`) or
set ``ORCHESTRATOR_ALERT_WEBHOOK`` to receive a JSON POST per alert.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from celery.utils.dispatch import Signal

from ..core import redact

log = logging.getLogger(__name__)

task_dead_lettered = Signal(name="task_dead_lettered", providing_args={"alert"})
schedule_failed = Signal(name="schedule_failed", providing_args={"alert"})
deadline_missed = Signal(name="deadline_missed", providing_args={"alert"})
breaker_changed = Signal(name="breaker_changed", providing_args={"alert"})
task_stuck = Signal(name="task_stuck", providing_args={"alert"})

#: an alert's ``"event"`` -> what the log line says, and the signal sent (no event: dead letter)
_KINDS: dict[str | None, tuple[str, Signal]] = {
    None: ("task dead-lettered", task_dead_lettered),
    "schedule_failed": ("schedule could not fire", schedule_failed),
    "deadline_missed": ("deadline missed", deadline_missed),
    "breaker_changed": ("circuit breaker changed state", breaker_changed),
    "task_stuck": ("task stuck (no progress)", task_stuck),
}


def raise_alert(alert: dict[str, Any], *, webhook: str | None, actor: str, timeout: float = 5.0) -> None:
    """Deliver ``alert`` everywhere it is wanted; a failing receiver never fails the caller."""
    what, signal = _KINDS.get(alert.get("event"), _KINDS[None])
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
