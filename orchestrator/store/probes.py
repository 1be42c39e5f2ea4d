"""Probe instrumentation, kept out of the product schema.

With ``ORCHESTRATOR_RECORD_PROBE_EFFECTS=1`` the probe tasks (``tasks/probes.py``) write one
row per execution (run, key, attempt, pid) so the fault tests and the chaos soak can count
how often a body really ran. The table has its own metadata: it is created on first use and
is neither in ``schema.py`` nor in the migrations.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .dbtime import db_now

probe_metadata = sa.MetaData()

probe_effects = sa.Table(
    "orc_probe_effects",
    probe_metadata,
    sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(32), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_orc_probe_effects_run", "run_id", "key"),
)

_ready: set[int] = set()


def ensure_probe_table(engine: Engine) -> None:
    """Create the table unless it exists; safe when many processes race to create it."""
    try:
        probe_metadata.create_all(engine, checkfirst=True)
    except (sa.exc.ProgrammingError, sa.exc.IntegrityError):
        # another process created it between our check and our CREATE
        if not sa.inspect(engine).has_table(probe_effects.name):
            raise


def record_effect(engine: Engine, run_id: str, key: str, attempt: int, pid: int) -> None:
    """Note one execution of a probe body."""
    if id(engine) not in _ready:
        ensure_probe_table(engine)
        _ready.add(id(engine))
    with engine.begin() as conn:
        conn.execute(probe_effects.insert().values(run_id=run_id, key=key, attempt=attempt, pid=pid, at=db_now()))
