"""The DAG registry's rows: ``orc_dags`` (a name per tenant, its latest version, paused or not)
and ``orc_dag_versions`` (each version's definition and content hash).

A registration runs under the DAG row's lock (``SELECT ... FOR UPDATE`` after an ``INSERT ... ON
CONFLICT DO NOTHING`` that makes it): two processes registering one content at once make one
version, the second finds it; a content that differs from the latest makes ``latest + 1``."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from . import schema as s
from .database import Database
from .dbtime import db_now

t_dags = s.dags
t_versions = s.dag_versions

#: what a version's listing reads (its spec apart: a listing of many versions does not need it)
VERSION_COLUMNS = (
    t_versions.c.tenant,
    t_versions.c.name,
    t_versions.c.version,
    t_versions.c.content_hash,
    t_versions.c.registered_at,
    t_versions.c.registered_by,
)


class DagRows:
    def __init__(self, db: Database) -> None:
        self.db = db

    def register(
        self, tenant: str, name: str, spec: dict[str, Any], content_hash: str, by: str | None
    ) -> tuple[int, bool]:
        """Store ``spec`` as the newest version of ``(tenant, name)`` unless the latest version
        holds the same content. Returns ``(version, created)``."""

        def tx(conn: Connection) -> tuple[int, bool]:
            now = conn.execute(sa.select(db_now())).scalar_one()
            conn.execute(
                postgresql.insert(t_dags)
                .values(tenant=tenant, name=name, latest_version=0, paused=False, created_at=now, updated_at=now)
                .on_conflict_do_nothing(index_elements=[t_dags.c.tenant, t_dags.c.name])
            )
            latest = conn.execute(
                sa.select(t_dags.c.latest_version).where(*self._key(tenant, name)).with_for_update()
            ).scalar_one()
            if latest:
                held = conn.execute(
                    sa.select(t_versions.c.content_hash).where(
                        *self._key(tenant, name, t_versions), t_versions.c.version == latest
                    )
                ).scalar_one()
                if held == content_hash:
                    return latest, False
            version = latest + 1
            conn.execute(
                t_versions.insert().values(
                    tenant=tenant, name=name, version=version, content_hash=content_hash, spec=spec,
                    registered_at=now, registered_by=by,
                )
            )  # fmt: skip
            conn.execute(t_dags.update().where(*self._key(tenant, name)).values(latest_version=version, updated_at=now))
            return version, True

        return self.db.transaction(tx)

    @staticmethod
    def _key(tenant: str, name: str, table: sa.Table = t_dags) -> list[Any]:
        return [table.c.tenant == tenant, table.c.name == name]

    def get(self, tenant: str, name: str) -> Any:
        """The DAG's row (``latest_version``, ``paused``, ...), or None."""
        query = sa.select(t_dags).where(*self._key(tenant, name))
        return self.db.read(lambda conn: conn.execute(query).first())

    def all(self, tenant: str | None) -> list[Any]:
        """Every registered DAG (of ``tenant``; None: of every tenant), by tenant and name."""
        query = sa.select(t_dags).order_by(t_dags.c.tenant, t_dags.c.name)
        if tenant is not None:
            query = query.where(t_dags.c.tenant == tenant)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def version(self, tenant: str, name: str, version: int | None) -> Any:
        """A version's row with its spec (``version`` None: the latest), or None."""

        def read(conn: Connection) -> Any:
            number = version
            if number is None:
                number = conn.execute(sa.select(t_dags.c.latest_version).where(*self._key(tenant, name))).scalar()
                if not number:
                    return None
            return conn.execute(
                sa.select(t_versions).where(*self._key(tenant, name, t_versions), t_versions.c.version == number)
            ).first()

        return self.db.read(read)

    def versions(self, tenant: str, name: str) -> list[Any]:
        """The DAG's versions, oldest first, without their specs."""
        query = sa.select(*VERSION_COLUMNS).where(*self._key(tenant, name, t_versions)).order_by(t_versions.c.version)
        return list(self.db.read(lambda conn: conn.execute(query).all()))

    def set_paused(self, tenant: str, name: str, paused: bool, by: str | None) -> Any:
        """Pause or unpause; returns the row as it is now, or None (no such DAG)."""

        def tx(conn: Connection) -> Any:
            now = conn.execute(sa.select(db_now())).scalar_one()
            return conn.execute(
                t_dags.update()
                .where(*self._key(tenant, name))
                .values(
                    paused=paused,
                    paused_at=now if paused else None,
                    paused_by=by if paused else None,
                    updated_at=now,
                )
                .returning(*t_dags.c)
            ).first()

        return self.db.transaction(tx)

    @staticmethod
    def paused(conn: Connection, tenant: str, name: str) -> bool:
        """Whether the DAG is registered and paused (in the caller's transaction)."""
        query = sa.select(t_dags.c.paused).where(t_dags.c.tenant == tenant, t_dags.c.name == name)
        return bool(conn.execute(query).scalar())

    def is_paused(self, tenant: str, name: str) -> bool:
        return self.db.read(lambda conn: self.paused(conn, tenant, name))
