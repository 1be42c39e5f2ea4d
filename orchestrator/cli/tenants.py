"""``orchestrator tenant``: tenants' weights, limits and queues."""

from __future__ import annotations

import click

from . import base


@click.group()
def tenant() -> None:
    """Tenants' settings (stored in the database)."""


@tenant.command("set")
@click.argument("name")
@click.option("--weight", type=float, default=None, help="Share of the free slots relative to others (default 1).")
@click.option("--max-running", type=int, default=None, help="Most tasks QUEUED or RUNNING at once, all queues.")
@click.option("--no-max-running", is_flag=True, help="Remove the tenant's limit.")
@click.option(
    "--dedicated/--shared",
    default=None,
    help="Its own queues (served by `orchestrator worker --tenant NAME`), or the shared ones.",
)
def tenant_set(
    name: str, weight: float | None, max_running: int | None, no_max_running: bool, dedicated: bool | None
) -> None:
    """Set a tenant's weight in the fair share of admission (within a priority class, free
    slots go to the tenant with the fewest tasks in flight per unit of weight: weights 3 and 1
    give three slots to one while both have READY work) and/or its limit of tasks in flight."""
    orc = base._ready_store()
    if weight is None and max_running is None and not no_max_running and dedicated is None:
        raise click.UsageError("give --weight, --max-running, --no-max-running, --dedicated or --shared")
    if dedicated is not None:
        orc.tenants.set_dedicated(name, dedicated)
    if weight is not None:
        orc.tenants.set_weight(name, weight)
    if max_running is not None or no_max_running:
        orc.tenants.set_limit(name, None if no_max_running else max_running)
    weight_now, limit_now, dedicated_now = orc.tenants.all().get(name, (1.0, None, False))
    queues = "dedicated queues" if dedicated_now else "shared queues"
    click.echo(f"tenant {name}: weight {weight_now:g}, max running {limit_now or 'unlimited'}, {queues}")


@tenant.command("list")
def tenant_list() -> None:
    """Tenants with settings (every other tenant weighs 1 and has no limit)."""
    for name, (weight, limit, dedicated) in sorted(base._ready_store().tenants.all().items()):
        queues = "dedicated" if dedicated else "shared"
        click.echo(f"{name}  weight {weight:g}  max running {limit or 'unlimited'}  queues {queues}")
