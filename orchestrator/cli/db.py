"""``orchestrator db``: the database schema (Alembic migrations) and pruning the ledger."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import base
from .base import _dump, _Path


def _engine() -> Any:
    """An engine on the configured database without the schema check (for `db` commands)."""
    from ..core.config import Settings
    from ..store import make_engine

    return make_engine(Settings.from_env().database_url)


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command()
@click.argument("revision", default="head")
def upgrade(revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    from ..store import migrate

    engine = _engine()
    migrate.upgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
@click.argument("revision")
def downgrade(revision: str) -> None:
    """Migrate the database down to REVISION ("base" drops every table)."""
    from ..store import migrate

    engine = _engine()
    migrate.downgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
def current() -> None:
    """Print the database's revision and the newest one."""
    from ..store import migrate

    click.echo(f"current: {migrate.current(_engine())}  head: {migrate.head()}")


@db.command()
def check() -> None:
    """Exit 1 unless the database is at head and matches the declared schema exactly."""
    from ..store import migrate

    engine = _engine()
    at, head = migrate.current(engine), migrate.head()
    diff = migrate.schema_diff(engine)
    if at != head or diff:
        click.echo(f"schema mismatch: revision {at} (head {head})", err=True)
        for item in diff:
            click.echo(f"  {item}", err=True)
        sys.exit(1)
    click.echo(f"schema matches orchestrator/store/schema/ at revision {head}")


def _age(text: str, option: str) -> Any:
    """An age (``30d``, ``12h``, ``90m``) as a timedelta, or None when ``text`` is not one."""
    import datetime as dt
    import re

    from ..core.errors import ValidationError

    found = re.fullmatch(r"(\d{1,6})([dhm])", text.strip())
    if not found:
        return None
    unit = {"d": "days", "h": "hours", "m": "minutes"}[found.group(2)]
    age = dt.timedelta(**{unit: int(found.group(1))})
    if age > dt.timedelta(days=365 * 1000):
        raise ValidationError(f"{option} {text}: an age of at most 1000 years (365000d)")
    return age


def _cut_off(text: str) -> Any:
    """``--before``: an ISO 8601 date or date-time (UTC without an offset), or an age: ``30d``,
    ``12h``, ``90m``. Anything else, or an instant out of range, is a ValidationError (one line,
    exit 2)."""
    import datetime as dt

    from ..core.errors import ValidationError

    age = _age(text, "--before")
    if age is not None:
        return dt.datetime.now(dt.UTC) - age
    try:
        moment = dt.datetime.fromisoformat(text.strip())
        return moment.astimezone(dt.UTC) if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    except (ValueError, OverflowError):
        raise ValidationError(
            f"--before {text!r}: give an ISO 8601 date or date-time (from year 1), or an age such as 30d, 12h"
        ) from None


@db.command("clean")
@click.option(
    "--before",
    "before",
    required=True,
    help="Remove runs created and finished before this: a date, a date-time or an age (30d, 12h).",
)
@click.option(
    "--archive",
    type=_Path(dir_okay=False),
    default=None,
    help="Append each batch to this file (JSON lines, one run with its tasks, edges and ledger each), flushed to the"
    " disk before the batch is deleted; a failed write removes nothing of its batch.",
)
@click.option("--batch", type=click.IntRange(1, 10_000), default=500, show_default=True, help="Runs per transaction.")
@click.option(
    "--pause",
    type=click.FloatRange(0, 60),
    default=0.0,
    show_default=True,
    help="Seconds left to the running work between two batches (a slower clean that takes less from the hot path).",
)
@click.option(
    "--keep-keys",
    default="90d",
    show_default=True,
    metavar="AGE",
    help="How long a removed run's idempotency key is kept (a submit with it is refused, naming the removed run);"
    " older kept keys are forgotten (0d: none kept).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print the totals as JSON.")
def db_clean(
    before: str, archive: str | None, batch: int, pause: float, keep_keys: str, dry_run: bool, as_json: bool
) -> None:
    """Prune the ledger: remove the final runs (SUCCEEDED, FAILED, CANCELLED) created and finished
    before --before, with their tasks, edges and ledger rows, in short batches (a RUNNING run is
    never touched; the hot path is not held up). The removed runs' idempotency keys are kept for
    --keep-keys. One tenant's only with `orchestrator --tenant T`."""
    from ..core.errors import ValidationError

    cut = _cut_off(before)
    keep = _age(keep_keys, "--keep-keys")
    if keep is None:
        raise ValidationError(f"--keep-keys {keep_keys!r}: give an age such as 90d, 12h or 0d")
    orc = base._ready_store()
    cleanup = orc.store.cleanup
    if dry_run:
        found = cleanup.count(cut, tenant=orc.tenant)
    else:
        found = cleanup.clean(cut, batch=batch, tenant=orc.tenant, archive=archive, pause=pause, keep_keys=keep)
    if as_json:
        _dump({"before": cut.isoformat(), "dry_run": dry_run, **found.to_json()})
        return
    what = "would remove" if dry_run else "removed"
    states = ", ".join(f"{n} {st.lower()}" for st, n in sorted(found.by_state.items())) or "none"
    click.echo(
        f"{what} {found.runs:,} run(s) ({states}) created before {cut.isoformat(timespec='seconds')}:"
        f" {found.tasks:,} task(s), {found.edges:,} edge(s), {found.events:,} ledger row(s)"
        + ("" if dry_run else f" in {found.batches} batch(es)")
        + (f"; archived to {archive}" if archive and not dry_run else "")
        + (f"; {found.keys_kept:,} idempotency key(s) {'to keep' if dry_run else 'kept'}" if found.keys_kept else "")
        + (f", {found.keys_forgotten:,} older one(s) forgotten" if found.keys_forgotten else "")
    )
