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

    def set_max_running(self, name: str, max_running: int | None) -> None:
        """Insert or update a tenant's limit of tasks in flight (``None``: no limit)."""

        def tx(conn: sa.Connection) -> None:
            updated = conn.execute(
                t_tenants.update().where(t_tenants.c.name == name).values(max_running=max_running, updated_at=db_now())
            )
            if updated.rowcount == 0:
                conn.execute(
                    t_tenants.insert().values(name=name, weight=1.0, max_running=max_running, updated_at=db_now())
                )

        self.db.transaction(tx)

    def set_dedicated(self, name: str, dedicated: bool) -> None:
        """Whether the tenant's tasks go to its own queues (from its next submit on)."""

        def tx(conn: sa.Connection) -> None:
            updated = conn.execute(
                t_tenants.update().where(t_tenants.c.name == name).values(dedicated=dedicated, updated_at=db_now())
            )
            if updated.rowcount == 0:
                conn.execute(t_tenants.insert().values(name=name, weight=1.0, dedicated=dedicated, updated_at=db_now()))

        self.db.transaction(tx)

    def dedicated(self) -> set[str]:
        """The tenants with dedicated queues (``tenant set --dedicated``)."""
        found = self.db.read(
            lambda conn: (
                conn.execute(sa.select(t_tenants.c.name).where(t_tenants.c.dedicated.is_(True))).scalars().all()
            )
        )
        return set(found)

    def settings(self) -> dict[str, tuple[float, int | None, bool]]:
        """``{tenant: (weight, max_running, dedicated)}`` of the tenants with a row."""
        with self.db.engine.connect() as conn:
            found = conn.execute(
                sa.select(t_tenants.c.name, t_tenants.c.weight, t_tenants.c.max_running, t_tenants.c.dedicated)
            ).all()
        return {n: (float(w), m, bool(d)) for n, w, m, d in found}

    def weights(self) -> dict[str, float]:
        with self.db.engine.connect() as conn:
            return {n: float(w) for n, w in conn.execute(sa.select(t_tenants.c.name, t_tenants.c.weight)).all()}
