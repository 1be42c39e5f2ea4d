"""Celery signatures read without Celery: a node's task given as a signature (``extract.s(day=1)``,
a ``dict`` underneath), a task object or a task name, split into its name, arguments and the
options the orchestrator honours. The core imports no Celery: a signature is duck-typed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ValidationError
from ..routing import Priority
from .bounds import short
from .coerce import enum_value

#: What :meth:`DAG.task` does with each option of a Celery signature (``sig.set(...)``);
#: any other option is refused too. The orchestrator publishes every message itself, one
#: per attempt, with its own task id, headers and routing, and keeps every delay in the
#: database: an option that would change that would break the promise, and is refused with
#: a :class:`ValidationError` naming the node and the option; one that only tunes how Celery
#: would have published or stored a result changes nothing here, and is ignored.
SIGNATURE_OPTIONS: dict[str, str] = {
    # honoured: they become the node's fields of the same name
    "queue": "honoured",
    "priority": "honoured",
    "soft_time_limit": "honoured",
    "time_limit": "honoured",
    # ignored, harmless: no result backend is read, and publishing (retries included) is the orchestrator's
    "ignore_result": "ignored",
    "add_to_parent": "ignored",
    "retry": "ignored",
    "retry_policy": "ignored",
    "compression": "ignored",
    "serializer": "ignored",  # "json" only: every message is JSON
    # refused
    "countdown": "the orchestrator never leaves a delay (an ETA) in the broker: delays live in the database",
    "eta": "the orchestrator never leaves a delay (an ETA) in the broker: delays live in the database",
    "expires": "a message that expires is dropped and its task would never finish",
    "link": "a callback runs outside the DAG: make it a downstream node",
    "link_error": "an error callback runs outside the DAG: make it a downstream node (trigger_rule 'one_failed')",
    "task_id": "the orchestrator sets each attempt's task id",
    "headers": "the orchestrator sets the message headers",
    "shadow": "the task is shown under its real name",
    "exchange": "routing is by queue: set queue",
    "routing_key": "routing is by queue: set queue",
    "exchange_type": "routing is by queue: set queue",
    "chain": "a chain is not one node: make each part a node and link them with upstream",
    "chord": "a chord is not one node: make each part a node and link them with upstream",
    "group_id": "a group is not one node: make each part a node",
    "group_index": "a group is not one node: make each part a node",
    "parent_id": "the orchestrator publishes each attempt itself",
    "root_id": "the orchestrator publishes each attempt itself",
}


def task_parts(task: Any, dag: str, key: str) -> tuple[str, Sequence[Any], Mapping[str, Any], dict[str, Any]]:
    """Split a signature, task object or name into (name, args, kwargs, node options) without
    importing Celery; the options are the signature's honoured ones (:data:`SIGNATURE_OPTIONS`)."""
    if isinstance(task, str):
        return task, (), {}, {}
    if isinstance(task, Mapping) and "task" in task:  # a celery Signature is a dict
        kind = task.get("subtask_type")
        if kind is not None:
            raise ValidationError(
                f"a Celery {kind} is not one task: make each of its parts a node and link them with upstream",
                dag=dag,
                node=key,
            )
        options = signature_options(task.get("options"), dag, key)
        return str(task["task"]), tuple(task.get("args") or ()), dict(task.get("kwargs") or {}), options
    name = getattr(task, "name", None)
    if isinstance(name, str):
        return name, (), {}, {}
    raise ValidationError(
        f"task must be a Celery signature, task or task name, not {type(task).__name__}",
        dag=dag,
        node=key,
    )


def signature_options(options: Any, dag: str, key: str) -> dict[str, Any]:
    """The node fields a signature's ``options`` set; raise :class:`ValidationError` for an
    option that is refused (:data:`SIGNATURE_OPTIONS`) or unknown."""
    if not options:
        return {}
    if not isinstance(options, Mapping):
        raise ValidationError(f"signature options must be a mapping, not {type(options).__name__}", dag=dag, node=key)
    found: dict[str, Any] = {}
    for option, value in options.items():
        what = SIGNATURE_OPTIONS.get(option) if isinstance(option, str) else None
        if what == "honoured":
            if option == "priority":
                if not isinstance(value, (str, Priority)):
                    raise ValidationError(
                        f"signature option priority={short(value)}: give a priority class ('high', 'default'"
                        " or 'low'); a number means opposite things on Redis and RabbitMQ",
                        dag=dag,
                        node=key,
                    )
                value = enum_value(Priority, value, "signature option priority", dag, key)
            found[option] = value
        elif what == "ignored":
            if option == "serializer" and value not in (None, "json"):
                raise ValidationError(
                    f"signature option serializer={short(value)} is refused: every message is JSON", dag=dag, node=key
                )
        elif what is not None:
            raise ValidationError(f"signature option {option!r} is refused: {what}", dag=dag, node=key)
        else:
            raise ValidationError(
                f"signature option {short(option)} is refused: the orchestrator does not honour it"
                " (honoured: queue, priority, soft_time_limit, time_limit)",
                dag=dag,
                node=key,
            )
    return found


def with_signature_options(options: Mapping[str, Any], given: Mapping[str, Any], dag: str, key: str) -> dict[str, Any]:
    """The node fields of :meth:`DAG.task`'s keywords (``given``: ``queue``, ``priority``,
    ``soft_time_limit``, ``time_limit``) with the signature's honoured ``options`` added; a
    keyword may repeat an option, and raises :class:`ValidationError` when it contradicts one."""
    fields = dict(given)
    for option, value in options.items():
        if fields[option] is not None and fields[option] != value:
            raise ValidationError(
                f"{option} is set twice: {short(value)} on the signature, {short(fields[option])} as"
                " the keyword; keep one",
                dag=dag,
                node=key,
            )
        fields[option] = value
    return fields
