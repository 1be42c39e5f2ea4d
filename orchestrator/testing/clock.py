"""The virtual clock of a test database: what the database calls *now*, moved by a test.

The kit's database holds a schema ``orc_testclock`` with ``now()``, ``clock_timestamp()``,
``statement_timestamp()`` and ``transaction_timestamp()`` that return the server's own plus a
shift read from a one-row table, and the database's ``search_path`` is
``public, orc_testclock, pg_catalog``: ``pg_catalog`` named last, so an unqualified ``now()`` (in
the server functions, in the statements the store builds, in the tables' defaults, which are
bound when the migrations create them) is the clock's. Moving the clock is one ``UPDATE`` of
that row; every session sees it at its next statement (the shift is read at run time, never
folded into a cached plan). Only the kit's database has it: production never does.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

SCHEMA = "orc_testclock"
#: the search path of a test database: the clock's functions before ``pg_catalog``'s
SEARCH_PATH = f"public, {SCHEMA}, pg_catalog"

#: the statements that install the clock (idempotent)
INSTALL = (
    f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}",
    f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.clock (
        one boolean PRIMARY KEY DEFAULT true CHECK (one),
        shift interval NOT NULL DEFAULT interval '0',
        migrated text
    )""",
    f"INSERT INTO {SCHEMA}.clock (one) VALUES (true) ON CONFLICT DO NOTHING",
    f"""CREATE OR REPLACE FUNCTION {SCHEMA}.now() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE
        AS $$ SELECT pg_catalog.now() + (SELECT c.shift FROM {SCHEMA}.clock c) $$""",
    f"""CREATE OR REPLACE FUNCTION {SCHEMA}.transaction_timestamp() RETURNS timestamptz LANGUAGE sql STABLE
        PARALLEL SAFE AS $$ SELECT pg_catalog.transaction_timestamp() + (SELECT c.shift FROM {SCHEMA}.clock c) $$""",
    f"""CREATE OR REPLACE FUNCTION {SCHEMA}.statement_timestamp() RETURNS timestamptz LANGUAGE sql STABLE
        PARALLEL SAFE AS $$ SELECT pg_catalog.statement_timestamp() + (SELECT c.shift FROM {SCHEMA}.clock c) $$""",
    f"""CREATE OR REPLACE FUNCTION {SCHEMA}.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE
        AS $$ SELECT pg_catalog.clock_timestamp() + (SELECT c.shift FROM {SCHEMA}.clock c) $$""",
)


def install(conn: Connection, database: str) -> None:
    """Install the clock in the connected database and make it the database's default
    ``search_path`` (sessions opened from now on; ``database`` is its name)."""
    for statement in INSTALL:
        conn.exec_driver_sql(statement)
    quoted = conn.dialect.identifier_preparer.quote(database)
    conn.exec_driver_sql(f"ALTER DATABASE {quoted} SET search_path = {SEARCH_PATH}")


def _seconds(delta: dt.timedelta | float | None, days: float, hours: float, minutes: float, seconds: float) -> float:
    total = days * 86400.0 + hours * 3600.0 + minutes * 60.0 + seconds
    if isinstance(delta, dt.timedelta):
        total += delta.total_seconds()
    elif delta is not None:
        total += float(delta)
    return total


class Clock:
    """The virtual clock of one test database (see the module docstring).

    ``advance(hours=24)`` moves what the database calls now by a day, at once; ``now()`` reads
    it; ``advance_to(instant)`` moves it forward to an instant (never back); ``set(instant)``
    puts it anywhere (before a run starts: a test of a date); ``reset()`` back to real time.
    Each test starts at real time (the kit resets it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def now(self) -> dt.datetime:
        """What the database calls now."""
        with self.engine.connect() as conn:
            value: dt.datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        return value

    @property
    def shift(self) -> dt.timedelta:
        """How far the clock is from the server's real time."""
        with self.engine.connect() as conn:
            value: dt.timedelta = conn.execute(sa.text(f"SELECT shift FROM {SCHEMA}.clock")).scalar_one()
        return value

    def advance(
        self,
        delta: dt.timedelta | float | None = None,
        *,
        days: float = 0,
        hours: float = 0,
        minutes: float = 0,
        seconds: float = 0,
    ) -> dt.datetime:
        """Move the clock forward (``delta`` seconds or a timedelta, plus the keywords); returns
        the new now. A negative amount is refused: time in a run only moves forward."""
        amount = _seconds(delta, days, hours, minutes, seconds)
        if amount < 0:
            raise ValueError(f"the clock only moves forward (asked {amount} s); use set() before a run starts")
        return self._shift_by(amount)

    def advance_to(self, instant: dt.datetime) -> dt.datetime:
        """Move the clock forward to ``instant`` (nothing when it is already past); returns now."""
        if instant.tzinfo is None:
            instant = instant.replace(tzinfo=dt.UTC)
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {SCHEMA}.clock"
                    " SET shift = shift + greatest(CAST(:at AS timestamptz) - now(), interval '0')"
                ),
                {"at": instant},
            )
        return self.now()

    def set(self, instant: dt.datetime) -> dt.datetime:
        """Put the clock at ``instant`` (earlier or later than now); returns now."""
        if instant.tzinfo is None:
            instant = instant.replace(tzinfo=dt.UTC)
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE {SCHEMA}.clock SET shift = CAST(:at AS timestamptz) - pg_catalog.now()"),
                {"at": instant},
            )
        return self.now()

    def reset(self) -> None:
        """Back to the server's real time."""
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"UPDATE {SCHEMA}.clock SET shift = interval '0'")

    def _shift_by(self, seconds: float) -> dt.datetime:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE {SCHEMA}.clock SET shift = shift + make_interval(secs => :s)"), {"s": seconds}
            )
        return self.now()
