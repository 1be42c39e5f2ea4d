"""The message protocol (pure code): one Celery message per (task, attempt).

Everything that crosses the broker is defined here and nowhere else: the header names that
carry the fencing token, the task-id format ``<run>.<key>.<attempt>``, how a dispatch becomes
``send_task`` options, and how a received request is turned back into a fencing token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

#: message headers that carry the fencing token of an orchestrated message
HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT = "orc_run", "orc_key", "orc_attempt"
#: the header with the token's signature: HMAC-SHA256 over the task name and the token
HEADER_SIGNATURE = "orc_sig"
#: the header of a direct message (``Dispatch.direct``): its arguments are all its body gets, so a
#: worker may start the body before its claim; the signature then also covers the arguments
HEADER_DIRECT = "orc_direct"
FENCING_HEADERS = (HEADER_RUN, HEADER_KEY, HEADER_ATTEMPT, HEADER_SIGNATURE, HEADER_DIRECT)


def task_id(run_id: str, key: str, attempt: int) -> str:
    """The Celery task id of one attempt: ``<run>.<key>.<attempt>``.

    Unique per (run, key, generation, attempt) because a key never uses an attempt number twice
    in a run: a clear or a mark moves the attempt on, and a map expanded again starts each child
    after the highest attempt its key held (``orc_map_insert_v1``). So a message never carries an
    id that a revoke named (a worker would drop it, and the reconciler re-publish it, forever)."""
    return f"{run_id}.{key}.{attempt}"


def parse_task_id(value: str) -> tuple[str, str, int] | None:
    """Invert :func:`task_id`; ``None`` when ``value`` is not an orchestrator task id.

    Splits on the first and the last dot: a run id is hex and an attempt digits, so a key may
    itself hold dots (a task group's ``section_1.normal``)."""
    run_id, _, rest = value.partition(".")
    key, _, attempt = rest.rpartition(".")
    if not run_id or not key or not attempt.isdigit():
        return None
    return run_id, key, int(attempt)


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


def sign(key: bytes, task_name: str, token: FencingToken, direct: tuple[Any, Any] | None = None) -> str:
    """The signature of ``token`` for a message of ``task_name``: HMAC-SHA256 with the
    deployment's signing key (``orc_secrets``), hex. Only a process that can read the
    database can make it; a message whose signature does not verify never touches a run.

    A direct message's signature also covers its ``(args, kwargs)`` (as canonical JSON): its
    body may start before the claim, on the message's arguments alone."""
    text = "\x00".join((task_name, token.run_id, token.key, str(token.attempt)))
    if direct is not None:
        text += "\x00direct\x00" + canonical_arguments(*direct)
    return hmac.new(key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def canonical_arguments(args: Any, kwargs: Any) -> str:
    """``(args, kwargs)`` as the JSON a direct message's signature covers: the same text on the
    publisher (values from the database) and the worker (values from the message's JSON)."""
    return json.dumps([list(args or ()), kwargs or {}], sort_keys=True, separators=(",", ":"), allow_nan=False)


def verify(
    key: bytes, task_name: str, token: FencingToken, signature: Any, direct: tuple[Any, Any] | None = None
) -> bool:
    """Whether ``signature`` is :func:`sign` of ``token`` (and of a direct message's arguments)
    for ``task_name`` (constant time)."""
    if not isinstance(signature, str):
        return False
    try:
        expected = sign(key, task_name, token, direct)
    except (TypeError, ValueError):  # arguments that are no JSON: not what was signed
        return False
    return hmac.compare_digest(expected, signature)


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
    direct: bool = False,
) -> dict[str, Any]:
    """The ``send_task`` keyword options of one attempt's message (arguments excluded);
    ``signature`` is :func:`sign` of the token for the message's task name (and its arguments,
    for a ``direct`` one); ``priority`` the message priority (RabbitMQ only:
    :func:`message_priority`)."""
    headers: dict[str, Any] = {**token.headers(), HEADER_SIGNATURE: signature}
    if direct:
        headers[HEADER_DIRECT] = True
    options = {
        "queue": queue,
        "task_id": token.task_id,
        "headers": headers,
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
