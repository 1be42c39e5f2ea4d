"""Which live worker can take a task (pure code): the code versions workers advertise and runs
are pinned to, and the words that say why no worker can take a task.

A worker advertises one code version: ``ORCHESTRATOR_CODE_VERSION`` (a build id) or, unset, a
hash of the source files of the modules its registered tasks are defined in
(:func:`modules_hash`). Besides each queue ``Q`` it consumes, it consumes ``Q@VERSION``
(:func:`pinned_queues`); a run submitted with ``code_version=V`` routes every task to
``Q@V`` (:func:`pinned_queue`), so admission, which publishes a task only to a queue where a live
worker registered its name (``orc_worker_tasks``), holds it until a worker of version ``V`` that
has the task is live. A node's own queue cannot hold ``@`` (``QUEUE_RE``), so a queue name with
one is a pinned queue (:func:`split_pinned`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import ValidationError

#: a code version (``ORCHESTRATOR_CODE_VERSION``, a pin at submit): a build id or a hash
CODE_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
#: between a queue and the code version it is pinned to
PIN = "@"
#: the longest queue name the store keeps (``orc_tasks.queue``, ``orc_worker_tasks.queue``)
MAX_QUEUE_CHARS = 200
#: hex characters of a hash version (:func:`modules_hash`)
HASH_CHARS = 12


def code_version_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a code version, or ``None``."""
    if isinstance(value, str) and CODE_VERSION.fullmatch(value):
        return None
    return f"must be 1-64 letters, digits or . _ + - (starting with a letter or digit), not {value!r}"


def check_code_version(value: Any, dag: str | None = None) -> str:
    """``value`` as a code version, or :class:`ValidationError` naming the problem."""
    problem = code_version_problem(value)
    if problem is not None:
        raise ValidationError(f"code_version {problem}", dag=dag)
    return str(value)


def pinned_queue(queue: str, version: str) -> str:
    """The queue a run pinned to ``version`` uses for ``queue``: ``QUEUE@VERSION``, which only
    workers advertising that version consume."""
    return f"{queue}{PIN}{version}"


def split_pinned(queue: str) -> tuple[str, str | None]:
    """``(QUEUE, VERSION)`` of a pinned queue ``QUEUE@VERSION``; ``(queue, None)`` for any other."""
    base, pin, version = queue.rpartition(PIN)
    if not pin or not base or code_version_problem(version) is not None:
        return queue, None
    return base, version


def pinned_queues(queues: Iterable[str], version: str) -> list[str]:
    """The pinned queues a worker of ``version`` consuming ``queues`` consumes too: ``Q@VERSION``
    for each queue ``Q`` that is not pinned itself (nor another queue with ``@`` in its name, such
    as Celery's worker-direct queue) and whose pinned name the store can keep."""
    out = []
    for queue in queues:
        if PIN in queue:
            continue
        pinned = pinned_queue(queue, version)
        if len(pinned) <= MAX_QUEUE_CHARS:
            out.append(pinned)
    return sorted(set(out))


def modules_hash(sources: Mapping[str, bytes]) -> str:
    """A code version from source files: SHA-256 over each module's name and source, in module
    name order (the same code hashes alike wherever it is installed), :data:`HASH_CHARS` hex
    characters."""
    digest = hashlib.sha256()
    for module in sorted(sources):
        body = sources[module]
        for part in (module.encode(), b"\0", str(len(body)).encode(), b"\0", body):
            digest.update(part)
    return digest.hexdigest()[:HASH_CHARS]


def unregistered_text(queue: str, task_name: str, workers: Sequence[str]) -> str:
    """``no live worker on queue Q has task T registered (workers on Q: ...)``."""
    shown = ", ".join(workers) or "none"
    return f"no live worker on queue {queue} has task {task_name} registered (workers on {queue}: {shown})"


def dropped_text(worker: str, task_name: str, queue: str, having: Sequence[str]) -> str:
    """What a task a worker dropped as unregistered waits for (``dropped_by``)."""
    return (
        f"dropped by worker {worker}: task {task_name} is not registered there; held READY until a worker of"
        f" queue {queue} that has it registers or {worker} goes away (workers on {queue} with it:"
        f" {', '.join(having) or 'none'})"
    )


def workers_text(workers: Mapping[str, str | None]) -> str:
    """Workers with their code versions: ``a (version v1), b (no version)``, or ``none``."""
    shown = [f"{name} (version {v})" if v else f"{name} (no version)" for name, v in sorted(workers.items())]
    return ", ".join(shown) or "none"


def pinned_text(queue: str, version: str, task_name: str, workers: Mapping[str, str | None]) -> str:
    """Why a task of a run pinned to ``version`` is held on ``queue`` (its unpinned name): ``no
    live worker of code version V on queue Q has task T registered (workers on Q: ...)``, the live
    workers of ``queue`` with their versions."""
    return (
        f"no live worker of code version {version} on queue {queue} has task {task_name} registered"
        f" (workers on {queue}: {workers_text(workers)})"
    )
