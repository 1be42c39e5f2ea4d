"""The live workers as ``orchestrator workers`` lists them: each worker's queues (its pinned
``Q@VERSION`` ones included), the code version it advertises, the task names it registered, its
concurrency and when it was started and last seen; read in one connection. Scoped to a tenant,
the queues of other tenants' dedicated workers are not shown (nor a worker that consumes only
those)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from ...core.routing import queue_tenant
from ...core.workers import split_pinned
from .. import schema as s
from ..dbtime import aware, db_after
from ..workers import ANY_TASK
from .base import ReadsBase, t_workers


@dataclass(frozen=True)
class WorkerView:
    """A live worker (``orc_workers`` and its ``orc_worker_tasks`` rows)."""

    name: str
    #: every queue it consumes, sorted (pinned ``Q@VERSION`` ones included)
    queues: list[str]
    #: what it advertises: ``ORCHESTRATOR_CODE_VERSION`` or a hash of its task modules (``None``:
    #: a worker of an earlier release, or one that does not say)
    code_version: str | None
    #: the task names it registered, sorted (``None``: it does not say, and takes every name)
    tasks: list[str] | None
    concurrency: int
    started_at: dt.datetime | None
    seen_at: dt.datetime | None
    #: seconds since it was last seen, by the database clock
    seen_ago: float

    @property
    def task_count(self) -> int | None:
        """How many task names it registered (``None``: every name)."""
        return None if self.tasks is None else len(self.tasks)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queues": list(self.queues),
            "code_version": self.code_version,
            "task_count": self.task_count,
            "tasks": None if self.tasks is None else list(self.tasks),
            "concurrency": self.concurrency,
            "started_at": self.started_at.isoformat() if self.started_at else None,
            "seen_at": self.seen_at.isoformat() if self.seen_at else None,
            "seen_seconds_ago": round(self.seen_ago, 3),
        }


class WorkerReads(ReadsBase):
    """The live workers (``orchestrator workers``)."""

    def workers(self, worker_ttl: float) -> list[WorkerView]:
        """The workers seen within ``worker_ttl`` seconds, by name."""
        w, k = t_workers.c, s.worker_tasks.c
        with self.db.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    w.name, w.queues, w.code_version, w.concurrency, w.started_at, w.seen_at,
                    sa.func.extract("epoch", sa.func.now() - w.seen_at).label("ago"),
                )
                .where(w.seen_at > db_after(-worker_ttl))
                .order_by(w.name)
            ).all()  # fmt: skip
            names: dict[str, set[str]] = {}
            if rows:
                pairs = conn.execute(
                    sa.select(k.worker, k.task_name).where(k.worker.in_([r.name for r in rows])).distinct()
                ).all()
                for worker, task_name in pairs:
                    names.setdefault(worker, set()).add(task_name)
        out = []
        for r in rows:
            queues = sorted(q for q in (r.queues or []) if self._sees(q))
            if not queues and r.queues:
                continue
            found = names.get(r.name, set())
            tasks = None if ANY_TASK in found else sorted(found)
            out.append(
                WorkerView(
                    r.name,
                    queues,
                    r.code_version,
                    tasks,
                    int(r.concurrency),
                    aware(r.started_at),
                    aware(r.seen_at),
                    float(r.ago or 0.0),
                )
            )
        return out

    def _sees(self, queue: str) -> bool:
        """Whether these reads may name ``queue``: another tenant's dedicated queue is hidden from
        reads bound to a tenant."""
        if self.tenant is None:
            return True
        owner = queue_tenant(split_pinned(queue)[0])
        return owner is None or owner == self.tenant
