"""The ``orchestrator`` command line: the root group ``main`` and its commands, one module per
concept (``base`` holds what they share)."""

from __future__ import annotations

import click

from . import (
    actions,
    breakers,
    bulk,
    chaos,
    dags,
    db,
    demo,
    embedded,
    events,
    limits,
    runs,
    schedules,
    serve,
    shards,
    tenants,
    triggers,
    workers,
)
from .base import _Group


@click.group(cls=_Group)
@click.option(
    "--tenant",
    "as_tenant",
    metavar="TENANT",
    default=None,
    help="Act as this tenant (before the command: orchestrator --tenant acme status RUN; default:"
    " ORCHESTRATOR_TENANT; unset: every tenant, for the deployment's operator). Runs of other"
    " tenants are not found; submits go to this tenant.",
)
def main(as_tenant: str | None) -> None:
    """Durable DAG workflows on Celery.

    Configuration comes from ORCHESTRATOR_* environment variables; with none set, the
    embedded default (an embedded PostgreSQL + a file-based broker under ./.orchestrator) is used.
    """
    if as_tenant is not None:
        import os

        os.environ["ORCHESTRATOR_TENANT"] = as_tenant


#: every command of ``main``, in the order ``orchestrator --help`` was written in
COMMANDS: list[click.Command] = [
    demo.demo,
    workers.worker,
    workers.beat,
    db.db,
    embedded.embedded,
    runs.submit,
    runs.status,
    runs.runs,
    runs.watch,
    runs.graph,
    serve.serve,
    workers.reconcile,
    workers.workers,
    shards.shards,
    runs.events,
    tenants.tenant,
    limits.pool,
    limits.limit,
    breakers.breaker,
    dags.dag,
    runs.explain,
    runs.verify,
    actions.cancel,
    actions.retry,
    actions.skip,
    actions.clear,
    actions.mark,
    actions.rerun,
    actions.fail_task,
    bulk.bulk,
    schedules.schedule,
    events.emit,
    events.signal,
    events.approve,
    events.reject,
    triggers.on,
    schedules.backfill,
    chaos.chaos,
]
for _command in COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
