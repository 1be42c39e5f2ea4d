"""The message protocol (pure code): one Celery message per (task, attempt).

Everything that crosses the broker is defined here and nowhere else: the header names that
carry the fencing token, the task-id format ``<run>.<key>.<attempt>``, how a dispatch becomes
``send_task`` options, and how a received request is turned back into a fencing token.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

#: message headers that carry the fencing token of an orchestrated message
HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT = "orc_run", "orc_key", "orc_attempt"
#: the header with the token's signature: HMAC-SHA256 over the task name and the token
HEADER_SIGNATURE = "orc_sig"
FENCING_HEADERS = (HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT, HEADER_SIGNATURE)


def task_id(run_id: str, key: str, attempt: int) -> str:
    """The Celery task id of one attempt: ``<run>.<key>.<attempt>``."""
    return f"{run_id}.{key}.{attempt}"


def parse_task_id(value: str) -> tuple[str, str, int] | None:
    """Invert :func:`task_id`; ``None`` when ``value`` is not an orchestrator task id."""
    parts = value.split(".")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


@dataclass(frozen=True)
class FencingToken:
    """(run, key, attempt) of an orchestrated message: the claim, heartbeats and the outcome
    are accepted only while the task's row still holds this attempt."""

    run_id: str
    key: str
    attempt: int

    @property
    def task_id(self) -> str:
        return task_id(self.run_id, self.key, self.attempt)

    def headers(self) -> dict[str, Any]:
        return {HEADER_RUN: self.run_id, HEADER_KEY: self.key, HEADER_ATTEMPT: self.attempt}


def sign(key: bytes, task_name: str, token: FencingToken) -> str:
    """The signature of ``token`` for a message of ``task_name``: HMAC-SHA256 with the
    deployment's signing key (``orc_secrets``), hex. Only a process that can read the
    database can make it; a message whose signature does not verify never touches a run."""
    text = "\x00".join((task_name, token.run_id, token.key, str(token.attempt)))
    return hmac.new(key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def verify(key: bytes, task_name: str, token: FencingToken, signature: Any) -> bool:
    """Whether ``signature`` is :func:`sign` of ``token`` for ``task_name`` (constant time)."""
    return isinstance(signature, str) and hmac.compare_digest(sign(key, task_name, token), signature)


class MalformedHeaders(ValueError):
    """An orchestrated message whose fencing headers are present but unusable."""


def read_token(request: Any) -> FencingToken | None:
    """The fencing token carried by a Celery request (or any object with the header
    attributes); ``None`` for a plain Celery message; raises :class:`MalformedHeaders`."""
    run_id = getattr(request, HEADER_RUN, None)
    key = getattr(request, HEADER_KEY, None)
    attempt = getattr(request, HEADER_ATTEMPT, None)
    if run_id is None and key is None and attempt is None:
        return None
    if not isinstance(run_id, str) or not isinstance(key, str):
        raise MalformedHeaders(f"malformed orchestrator headers run={run_id!r} key={key!r}")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise MalformedHeaders(f"malformed orchestrator attempt header {attempt!r}")
    return FencingToken(run_id, key, attempt)


def send_options(
    token: FencingToken,
    *,
    queue: str,
    soft_time_limit: float | None,
    time_limit: float | None,
    signature: str,
    priority: int | None = None,
) -> dict[str, Any]:
    """The ``send_task`` keyword options of one attempt's message (arguments excluded);
    ``signature`` is :func:`sign` of the token for the message's task name; ``priority`` the
    message priority (RabbitMQ only: :func:`message_priority`)."""
    options = {
        "queue": queue,
        "task_id": token.task_id,
        "headers": {**token.headers(), HEADER_SIGNATURE: signature},
        "soft_time_limit": soft_time_limit,
        "time_limit": time_limit,
    }
    if priority is not None:
        options["priority"] = priority
    return options


#: the highest message priority of the queues on RabbitMQ (``x-max-priority``)
MAX_MESSAGE_PRIORITY = 9


def message_priority(rank: int) -> int:
    """RabbitMQ's message priority (higher first) for a priority class's rank (0 high, 1 default,
    2 low): 9, 5, 1. Admission already sends the higher classes first; the broker's priority
    only orders what waits in one queue."""
    return max(MAX_MESSAGE_PRIORITY - 4 * rank, 1)
