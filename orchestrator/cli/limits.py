"""Capacity shared across the deployment: ``orchestrator pool`` (slots) and ``orchestrator limit``
(rate limits)."""

from __future__ import annotations

import click

from . import base
from .base import _dump


@click.group()
def pool() -> None:
    """Named pools of slots (like Airflow pools), stored in the database.

    A node that names a pool (pool="warehouse", optionally pool_slots=2) holds that many of its
    slots while QUEUED or RUNNING; admission counts them from the task rows, so a slot frees
    when its task ends, its lease expires or its run is cancelled."""


@pool.command("set")
@click.argument("name")
@click.option("--slots", type=int, required=True, help="How many slots the pool has.")
@click.option("--description", default=None, help="What the pool protects.")
def pool_set(name: str, slots: int, description: str | None) -> None:
    """Create the pool NAME or change its slots."""
    orc = base._ready_store()
    orc.limits.set_pool(name, slots, description)
    found = next(p for p in orc.limits.pools() if p.name == name)
    click.echo(f"pool {name}: {found.slots} slot(s), {found.used} in use")


@pool.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"pools": [{"name", "slots", "used", "description"}]}.')
def pool_list(as_json: bool) -> None:
    """Every pool with its slots and how many are in use now."""
    pools = base._ready_store().limits.pools()
    if as_json:
        _dump(
            {"pools": [{"name": p.name, "slots": p.slots, "used": p.used, "description": p.description} for p in pools]}
        )
        return
    for p in pools:
        about = f"  {p.description}" if p.description else ""
        click.echo(f"{p.name}  slots {p.slots}  used {p.used}{about}")


@pool.command("remove")
@click.argument("name")
def pool_remove(name: str) -> None:
    """Remove the pool NAME (tasks that name it wait until it is set again)."""
    if not base._ready_store().limits.remove_pool(name):
        raise click.ClickException(f"no pool named {name!r}")
    click.echo(f"pool {name} removed")


@click.group()
def limit() -> None:
    """Rate limits for the whole deployment (token buckets in the database).

    A node that names a rate limit (rate_limit="stripe-api") takes one token of it each time
    admission sends it to a worker, whatever worker: Celery's own rate_limit is per worker
    process. Tokens are taken at admission, which runs on every completion, submit and
    reconciler tick (1 s): keep --burst at least the rate's tokens per tick."""


@limit.command("set")
@click.argument("key")
@click.option("--rate", required=True, help="Tokens per second, minute or hour: 10/s, 600/m, 5/h.")
@click.option(
    "--burst", type=int, default=None, help="Most tokens the bucket holds [default: one second's, at least 1]."
)
def limit_set(key: str, rate: str, burst: int | None) -> None:
    """Create the rate limit KEY or change it (a changed bucket starts full)."""
    found = base._ready_store().limits.set_rate_limit(key, rate, burst)
    click.echo(f"rate limit {key}: {found.rate_text}, burst {found.burst}")


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"rate_limits": [{"key", "rate", "burst", "tokens"}]}.')
def limit_list(as_json: bool) -> None:
    """Every rate limit with its rate, burst and the tokens in its bucket now."""
    found = base._ready_store().limits.rate_limits()
    if as_json:
        rows = [{"key": r.key, "rate": r.rate, "burst": r.burst, "tokens": round(r.tokens, 3)} for r in found]
        _dump({"rate_limits": rows})
        return
    for r in found:
        click.echo(f"{r.key}  {r.rate_text}  burst {r.burst}  tokens {r.tokens:.1f}")


@limit.command("remove")
@click.argument("key")
def limit_remove(key: str) -> None:
    """Remove the rate limit KEY (tasks that name it wait until it is set again)."""
    if not base._ready_store().limits.remove_rate_limit(key):
        raise click.ClickException(f"no rate limit named {key!r}")
    click.echo(f"rate limit {key} removed")
