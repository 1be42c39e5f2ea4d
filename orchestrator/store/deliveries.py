"""Redelivered broker messages, counted in the database (not in a worker's memory, which dies
with the pool process the message killed), and parked ones with their evidence."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from . import schema as s
from .database import Database
from .dbtime import db_now

t_deliveries = s.deliveries


class Deliveries:
    def __init__(self, db: Database) -> None:
        self.db = db

    def count(self, message_id: str, task_name: str) -> int:
        """Count one more delivery of a redelivered message; how many deliveries it has had
        (its first, which was not counted, included)."""

        def tx(conn: sa.Connection) -> int:
            bumped = conn.execute(
                t_deliveries.update()
                .where(t_deliveries.c.message_id == message_id)
                .values(deliveries=t_deliveries.c.deliveries + 1, last_at=db_now())
                .returning(t_deliveries.c.deliveries)
            ).scalar()
            if bumped is not None:
                return int(bumped)
            conn.execute(
                t_deliveries.insert().values(
                    message_id=message_id, task_name=task_name, deliveries=2, first_at=db_now(), last_at=db_now()
                )
            )
            return 2

        return self.db.transaction(tx)

    def park(self, message_id: str, evidence: dict[str, Any]) -> None:
        """Record that the message was parked, and why."""
        with self.db.engine.begin() as conn:
            conn.execute(
                t_deliveries.update()
                .where(t_deliveries.c.message_id == message_id)
                .values(parked_at=db_now(), evidence=evidence)
            )

    def parked(self) -> list[dict[str, Any]]:
        """Parked messages, newest first."""
        with self.db.engine.connect() as conn:
            found = conn.execute(
                sa.select(t_deliveries)
                .where(t_deliveries.c.parked_at.is_not(None))
                .order_by(t_deliveries.c.parked_at.desc())
            ).all()
        return [dict(r._mapping) for r in found]
