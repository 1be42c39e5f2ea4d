"""Tenants' settings (``orc_tenants``): the weight of each in the fair share of admission, its
limit of tasks in flight, whether it has dedicated queues. A tenant without a row weighs 1, has
no limit and shares the priority queues."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from . import schema as s
from .database import Database
from .dbtime import db_now

t_tenants = s.tenants


class Tenants:
    def __init__(self, db: Database) -> None:
        self.db = db

    def update(self, name: str, **values: Any) -> None:
        """Set some of a tenant's settings (the caller validated them), making its row if needed."""

        self.db.upsert(t_tenants, {"name": name}, {**values, "updated_at": db_now()}, defaults={"weight": 1.0})

    def dedicated(self) -> set[str]:
        """The tenants with dedicated queues (``tenant set --dedicated``)."""
        query = sa.select(t_tenants.c.name).where(t_tenants.c.dedicated.is_(True))
        return set(self.db.read(lambda conn: conn.execute(query).scalars().all()))

    def settings(self) -> dict[str, tuple[float, int | None, bool]]:
        """``{tenant: (weight, max_running, dedicated)}`` of the tenants with a row."""
        query = sa.select(t_tenants.c.name, t_tenants.c.weight, t_tenants.c.max_running, t_tenants.c.dedicated)
        found = self.db.read(lambda conn: conn.execute(query).all())
        return {n: (float(w), m, bool(d)) for n, w, m, d in found}
