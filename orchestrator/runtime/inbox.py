"""What a worker accepts from its queues: every message's envelope is checked before Celery
builds a request from it, and a message that fails the check is dropped with a log line.

Celery's consumer turns a malformed message into an exception in the worker's main process
(a string body, a ``timelimit`` of strings, a list as the task name, a missing ``id``), which
stops the worker; the message goes back to the queue and stops the next start too.
:class:`GuardedConsumer` (the ``worker_consumer`` of the project's app) checks each message
with :func:`problem` first and drops what fails, and drops a message whose handling raises
anyway (anything but a broker connection error) instead of letting it stop the worker.

Dropped messages are acknowledged (nothing is redelivered), logged at ERROR with the reason and
counted in :data:`DROPPED` by reason.

A message that comes back flagged ``redelivered`` (its pool process died, or its worker stopped
before acknowledging it) is counted in the database (``orc_deliveries``); past
``ORCHESTRATOR_MAX_REDELIVERIES`` deliveries it is parked: republished unchanged to the
``orchestrator.parked`` queue, which no worker consumes, with the evidence in the database, and
acknowledged. A task whose body kills its process can therefore not kill pool processes for
ever, with or without fencing headers. The count is written before the message runs (it is the
record of the delivery before, whose worker died: a direct message's body may have run there
before its claim); a message whose count cannot be written goes back to its queue. A message
the check lets through is a well-formed Celery protocol-2 message; whether it may touch a run
is decided later, in the pool process, by its fencing headers and their signature
(``orchestrator.runtime.worker``).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
from collections import Counter
from typing import Any

from celery.worker.consumer.consumer import Consumer
from kombu.entity import Exchange, Queue

from ..core.dag import short
from ..core.protocol import HEADER_ATTEMPT, HEADER_KEY, HEADER_RUN, HEADER_SIGNATURE
from ..core.routing import PARKED_QUEUE
from .process import current_orchestrator

log = logging.getLogger(__name__)

#: a message body larger than this is dropped unread (bytes)
MAX_BODY_BYTES = 10 * 1024 * 1024
#: deepest nesting of lists and objects accepted in a message body
MAX_BODY_DEPTH = 64
#: the longest task name, id or other string header accepted
MAX_HEADER_CHARS = 1024
#: the largest time limit a message may carry (seconds)
MAX_TIME_LIMIT = 10**7

#: messages dropped by this process, by reason (the reason's text up to its first colon)
DROPPED: Counter[str] = Counter()
_lock = threading.Lock()

_STRING_HEADERS = ("root_id", "parent_id", "group", "argsrepr", "kwargsrepr", "origin", "shadow", "lang")


def problem(message: Any) -> str | None:
    """Why ``message`` cannot be handled, or ``None`` when it is a well-formed protocol-2 task
    message: its headers, content type and body shape (``[args, kwargs, embed]``)."""
    headers = message.headers
    if not isinstance(headers, dict):
        return "headers: not a mapping"
    found = _headers_problem(headers)
    if found:
        return found
    if message.content_type != "application/json":
        return f"content type: {short(message.content_type, 80)} (only application/json is accepted)"
    raw = message.body
    if not isinstance(raw, (str, bytes, bytearray, memoryview)):
        return "body: not bytes"
    if len(raw) > MAX_BODY_BYTES:
        return f"body: {len(raw)} bytes, over {MAX_BODY_BYTES}"
    try:
        # kombu caches the decoded body on the message: Celery's request reads that, not a
        # second decode
        body = message.decode()
    except RecursionError:
        return "body: nested too deep to decode"
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, the body is unusable
        return f"body: not JSON ({short(str(exc), 80)})"
    return _body_problem(body)


def _headers_problem(headers: dict[str, Any]) -> str | None:
    task = headers.get("task")
    if not isinstance(task, str) or not task or len(task) > MAX_HEADER_CHARS:
        return f"task header: {short(task, 80)} (a task name is a non-empty string)"
    ident = headers.get("id")
    if not isinstance(ident, str) or not ident or len(ident) > MAX_HEADER_CHARS:
        return f"id header: {short(ident, 80)} (a task id is a non-empty string)"
    for name in _STRING_HEADERS:
        value = headers.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > 64 * MAX_HEADER_CHARS):
            return f"{name} header: {short(value, 80)} (a string or null)"
    limits = headers.get("timelimit")
    if limits is not None:
        if not isinstance(limits, (list, tuple)) or len(limits) != 2:
            return f"timelimit header: {short(limits, 80)} (a pair of [soft, hard] seconds)"
        for value in limits:
            if value is not None and not _seconds(value):
                return f"timelimit header: {short(limits, 80)} (seconds between 0.001 and {MAX_TIME_LIMIT}, or null)"
    retries = headers.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        return f"retries header: {short(retries, 80)} (a count)"
    for name in ("eta", "expires"):
        value = headers.get(name)
        if value is not None and not _instant(value):
            return f"{name} header: {short(value, 80)} (an ISO-8601 time or null)"
    fencing = [headers.get(h) for h in (HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT, HEADER_SIGNATURE)]
    if any(v is not None for v in fencing):
        run_id, key, attempt, signature = fencing
        if not all(isinstance(v, str) and 0 < len(v) <= MAX_HEADER_CHARS for v in (run_id, key, signature)):
            return f"fencing headers: run {short(run_id, 80)}, key {short(key, 80)}, signature {short(signature, 80)}"
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 1 <= attempt < 2**31:
            return f"fencing headers: attempt {short(attempt, 80)} (a positive integer)"
    return None


def _body_problem(body: Any) -> str | None:
    if not isinstance(body, list) or len(body) != 3:
        return f"body: {short(body, 80)} (a protocol-2 body is [args, kwargs, embed])"
    args, kwargs, embed = body
    if not isinstance(args, list):
        return f"body: args {short(args, 80)} (a list)"
    if not isinstance(kwargs, dict):
        return f"body: kwargs {short(kwargs, 80)} (an object)"
    if embed is not None and not isinstance(embed, dict):
        return f"body: embed {short(embed, 80)} (an object or null)"
    for name in ("callbacks", "errbacks", "chain"):
        value = (embed or {}).get(name)
        if value is not None and not isinstance(value, list):
            return f"body: {name} {short(value, 80)} (a list or null)"
    chord = (embed or {}).get("chord")
    if chord is not None and not isinstance(chord, dict):
        return f"body: chord {short(chord, 80)} (an object or null)"
    depth = _depth(body)
    if depth > MAX_BODY_DEPTH:
        return f"body: nested {depth} deep, over {MAX_BODY_DEPTH}"
    return None


def _depth(value: Any) -> int:
    """Nesting depth of lists and objects, without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_BODY_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in items)
    return deepest


def _seconds(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and 0.001 <= value <= MAX_TIME_LIMIT


def _instant(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > 64:
        return False
    try:
        dt.datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def drop(message: Any, reason: str, connection_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Acknowledge ``message`` (never redelivered), log why, count it."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    log.error(
        "dropping message %s (task %s) from %s: %s",
        short(headers.get("id"), 60),
        short(headers.get("task"), 60),
        short((message.delivery_info or {}).get("routing_key"), 60),
        reason,
    )
    count_drop(reason.split(":", 1)[0])
    message.ack_log_error(log, connection_errors)


def count_drop(reason: str) -> None:
    with _lock:
        DROPPED[reason] += 1


class GuardedConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, with every task message checked before Celery handles it."""

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        connection_errors = tuple(self.connection_errors)

        def on_task_received(message: Any) -> Any:
            reason = problem(message)
            if reason is not None:
                return drop(message, reason, connection_errors)
            if _redelivered(message) and self._too_many_deliveries(message):
                return None
            try:
                return handle(message)
            except connection_errors:
                raise
            except Exception as exc:
                log.exception("handling a message failed")
                return drop(
                    message, f"handling failed: {type(exc).__name__}: {short(str(exc), 200)}", connection_errors
                )

        return on_task_received

    def _too_many_deliveries(self, message: Any) -> bool:
        """Count a redelivery; past the limit park the message (and acknowledge it). ``True``
        when the message must not run now: parked, or sent back to its queue because its count
        could not be written."""
        headers = message.headers
        orc = current_orchestrator(self.app)
        try:
            deliveries = orc.count_delivery(headers["id"], headers["task"])
        except Exception:
            # the count is the record of the delivery before it, whose worker died (a direct
            # message's body may have run there before its claim): never run without it
            log.exception("could not count the redelivery of %s; it goes back to its queue", headers["id"])
            message.reject_log_error(log, tuple(self.connection_errors), requeue=True)
            return True
        limit = orc.settings.max_redeliveries
        if deliveries <= limit:
            return False
        reason = f"delivered {deliveries} times, over ORCHESTRATOR_MAX_REDELIVERIES={limit}"
        evidence = {
            "reason": reason,
            "headers": {k: short(v, 200) for k, v in headers.items()},
            "body_head": bytes(message.body[:512]).decode("utf-8", "replace"),
            "routing_key": (message.delivery_info or {}).get("routing_key"),
        }
        try:
            parked = Queue(PARKED_QUEUE, Exchange(PARKED_QUEUE, type="direct"), routing_key=PARKED_QUEUE)
            with self.app.producer_or_acquire() as producer:
                producer.publish(
                    message.body,
                    exchange=parked.exchange,
                    routing_key=PARKED_QUEUE,
                    declare=[parked],
                    headers={**headers, "orc_parked": reason},
                    content_type=message.content_type,
                    content_encoding=message.content_encoding,
                )
            orc.park_delivery(headers["id"], evidence)
        except Exception:
            log.exception("could not park message %s; running it", headers["id"])
            return False
        log.error("parked message %s (task %s) in %s: %s", headers["id"], headers["task"], PARKED_QUEUE, reason)
        count_drop("parked")
        message.ack_log_error(log, tuple(self.connection_errors))
        return True


def _redelivered(message: Any) -> bool:
    return bool((message.delivery_info or {}).get("redelivered") or message.headers.get("redelivered"))
