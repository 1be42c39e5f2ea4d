"""``orchestrator embedded``: the embedded default's PostgreSQL."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..core.errors import OrchestratorError


@click.group()
def embedded() -> None:
    """The embedded default's PostgreSQL (ORCHESTRATOR_DATABASE_URL unset): the first process
    that needs it starts it, the others attach, and it stays up until `embedded stop`."""


def _embedded_dir() -> Any:
    from ..core.config import Settings
    from ..store import embedded as emb

    settings = Settings.from_env()
    if not settings.embedded:
        raise OrchestratorError(
            "ORCHESTRATOR_DATABASE_URL names a database server: the embedded PostgreSQL is not in use"
        )
    return emb.data_dir_of(settings.database_url)


@embedded.command("start")
def embedded_start() -> None:
    """Start the embedded PostgreSQL (initialising its data directory the first time)."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    emb.ensure(pgdata)
    st = emb.status(pgdata)
    click.echo(f"embedded PostgreSQL running (pid {st.pid}) in {pgdata}")


@embedded.command("status")
def embedded_status() -> None:
    """Say whether the embedded PostgreSQL runs; exit 3 when it does not."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    st = emb.status(pgdata)
    if not st.running:
        click.echo(f"embedded PostgreSQL not running ({pgdata})")
        sys.exit(3)
    click.echo(f"embedded PostgreSQL running (pid {st.pid}) in {pgdata}, socket in {st.socket_dir}")


@embedded.command("stop")
def embedded_stop() -> None:
    """Stop the embedded PostgreSQL (stop the workers, beat and serve that use it first)."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    if emb.stop(pgdata):
        click.echo(f"embedded PostgreSQL stopped ({pgdata})")
    else:
        click.echo(f"embedded PostgreSQL was not running ({pgdata})")
