"""The worker registry: live workers, the queues they consume and their pool size. Admission
sizes the in-flight window from it (``admission.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import schema as s
from ..dbtime import db_after, db_now
from .database import Database

t_workers = s.workers


class WorkerRegistry:
    def __init__(self, db: Database, *, worker_ttl: float) -> None:
        self.db = db
        self.worker_ttl = worker_ttl

    def register(self, name: str, queues: Sequence[str], concurrency: int) -> None:
        """Insert or refresh a live worker's capacity (its pool size on its queues)."""

        def tx(conn: Connection) -> None:
            conn.execute(t_workers.delete().where(t_workers.c.name == name))
            conn.execute(
                t_workers.insert().values(
                    name=name, queues=sorted(queues), concurrency=concurrency, started_at=db_now(), seen_at=db_now()
                )
            )

        self.db.transaction(tx)

    def touch(self, name: str) -> bool:
        with self.db.engine.begin() as conn:
            res = conn.execute(t_workers.update().where(t_workers.c.name == name).values(seen_at=db_now()))
            return res.rowcount == 1

    def unregister(self, name: str) -> None:
        with self.db.engine.begin() as conn:
            conn.execute(t_workers.delete().where(t_workers.c.name == name))

    def live(self) -> int:
        """Workers seen within the worker TTL."""
        with self.db.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(t_workers.c.seen_at > db_after(-self.worker_ttl))
                ).scalar_one()
            )
