"""Tenants' settings: the weight of each in the fair share of admission (``orc_tenants``; a
tenant without a row weighs 1)."""

from __future__ import annotations

import sqlalchemy as sa

from .. import schema as s
from ..dbtime import db_now
from .database import Database

t_tenants = s.tenants


class Tenants:
    def __init__(self, db: Database) -> None:
        self.db = db

    def set_weight(self, name: str, weight: float) -> None:
        """Insert or update a tenant's weight (the caller validated both)."""

        def tx(conn: sa.Connection) -> None:
            updated = conn.execute(
                t_tenants.update().where(t_tenants.c.name == name).values(weight=weight, updated_at=db_now())
            )
            if updated.rowcount == 0:
                conn.execute(t_tenants.insert().values(name=name, weight=weight, updated_at=db_now()))

        self.db.transaction(tx)

    def weights(self) -> dict[str, float]:
        with self.db.engine.connect() as conn:
            return {n: float(w) for n, w in conn.execute(sa.select(t_tenants.c.name, t_tenants.c.weight)).all()}
