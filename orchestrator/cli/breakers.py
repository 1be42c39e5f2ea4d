"""``orchestrator breaker``: circuit breakers per resource."""

from __future__ import annotations

from typing import Any

import click

from . import base
from .base import _by, _dump


@click.group()
def breaker() -> None:
    """Circuit breakers per resource, stored in the database.

    A node that declares resources (resources=["stripe", "erp:{tenant}"]) has its outcomes
    counted by each resource's breaker; open, admission holds the resource's READY tasks (no
    retry burned, nothing published) while other work takes the slots; half-open, a few leased
    probes decide; closed again, admission ramps the resource up in waves of 1, 2, 4 ...

    Deployment-wide: with `orchestrator --tenant T` every breaker command is refused (exit 2)."""


def _breaker_text(b: Any) -> str:
    state = b.state.replace("_", "-")
    if b.mode != "on":
        state = f"{state} ({'metrics only' if b.mode == 'metrics' else 'disabled'})"
    elif b.state == "open":
        state += " until an operator closes it" if b.forced or b.open_until is None else f" until {b.open_until}"
    elif b.state == "half_open":
        state += f", {b.probes_left} of {b.probes} probe permit(s) left"
    elif b.wave is not None:
        state += f", ramping: wave of {b.wave} ({b.wave_admitted} admitted)"
    rate = f"{b.failures}/{b.calls} failed" if b.calls else "no calls"
    return (
        f"{b.name}  {state}  {rate} in {b.window_seconds:g}s  trips at >= {b.min_calls} calls, >= {b.min_failures}"
        f" failures, >= {b.failure_rate:g}  open {b.open_min:g}..{b.open_max:g}s  probes {b.probes}"
    )


@breaker.command("set")
@click.argument("name")
@click.option("--window", default="60s", show_default=True, help="The sliding window the rule counts over.")
@click.option("--min-calls", type=int, default=20, show_default=True, help="Fewest calls in the window to trip.")
@click.option("--failure-rate", type=float, default=0.5, show_default=True, help="Share of failed calls that trips it.")
@click.option("--min-failures", type=int, default=5, show_default=True, help="Fewest failures in the window to trip.")
@click.option(
    "--open-for",
    default="30s..10m",
    show_default=True,
    help="How long it stays open: 30s, or 30s..10m (doubled per consecutive re-open up to the most).",
)
@click.option("--probes", type=int, default=1, show_default=True, help="Probe permits when half-open.")
@click.option("--probe-lease", default=None, help="A probe's lease [default: the window, at least 60s].")
@click.option("--ramp-max", type=int, default=64, show_default=True, help="Largest ramp wave after closing (1: none).")
@click.option(
    "--failure-on", multiple=True, help="An exception class name counted as the resource's failure (repeatable)."
)
@click.option("--metrics-only", is_flag=True, help="Count and show, never hold.")
def breaker_set(
    name: str,
    window: str,
    min_calls: int,
    failure_rate: float,
    min_failures: int,
    open_for: str,
    probes: int,
    probe_lease: str | None,
    ramp_max: int,
    failure_on: tuple[str, ...],
    metrics_only: bool,
) -> None:
    """Create the breaker of the resource NAME or change its settings (its state stays)."""
    found = base._ready_store().breakers.set(
        name, window=window, min_calls=min_calls, failure_rate=failure_rate, min_failures=min_failures,
        open_for=open_for, probes=probes, probe_lease=probe_lease, ramp_max=ramp_max, failure_on=failure_on,
        mode="metrics" if metrics_only else "on", by=_by(),
    )  # fmt: skip
    click.echo(_breaker_text(found))


@breaker.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the breaker and its latest ledger rows as JSON.")
def breaker_show(name: str, as_json: bool) -> None:
    """The breaker NAME: its state, its window's counts, its probes out and its latest ledger rows."""
    orc = base._ready_store()
    found = orc.breakers.get(name)
    events = orc.breakers.events(name, limit=20)
    if as_json:
        _dump({**found.to_dict(), "events": [e.to_dict() for e in events]})
        return
    click.echo(_breaker_text(found))
    for run_id, key, attempt, until in found.probes_out:
        click.echo(f"  probe {run_id}/{key} #{attempt} leased until {until.isoformat()}")
    for e in events:
        who = f" by {e.by}" if e.by else ""
        click.echo(f"  {e.at.isoformat()}  {e.from_state or '-'} -> {e.to_state}  {e.actor}{who}  {e.reason or ''}")


@breaker.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"breakers": [...]}.')
def breaker_list(as_json: bool) -> None:
    """Every breaker with its state and its window's counts."""
    found = base._ready_store().breakers.all()
    if as_json:
        _dump({"breakers": [b.to_dict() for b in found]})
        return
    for b in found:
        click.echo(_breaker_text(b))


def _breaker_action(action: str, name: str, reason: str | None) -> None:
    orc = base._ready_store()
    act = {"open": orc.breakers.open, "close": orc.breakers.close, "disable": orc.breakers.disable}[action]
    click.echo(_breaker_text(act(name, by=_by(), reason=reason)))  # an unknown name: error, exit 2


@breaker.command("open")
@click.argument("name")
@click.option("--reason", default=None, help="Why, for the ledger.")
def breaker_open(name: str, reason: str | None) -> None:
    """Force the breaker NAME open until `breaker close` (its resource's READY tasks are held)."""
    _breaker_action("open", name, reason)


@breaker.command("close")
@click.argument("name")
@click.option("--reason", default=None, help="Why, for the ledger.")
def breaker_close(name: str, reason: str | None) -> None:
    """Close the breaker NAME now (no ramp) and turn it back on; its held tasks are admitted."""
    _breaker_action("close", name, reason)


@breaker.command("disable")
@click.argument("name")
@click.option("--reason", default=None, help="Why, for the ledger.")
def breaker_disable(name: str, reason: str | None) -> None:
    """The breaker NAME never trips and counts nothing (until `breaker set` or `breaker close`)."""
    _breaker_action("disable", name, reason)


@breaker.command("remove")
@click.argument("name")
def breaker_remove(name: str) -> None:
    """Remove the breaker NAME: its resource's tasks are no longer counted nor held."""
    from ..store.breakers import UnknownBreakerError

    if not base._ready_store().breakers.remove(name, by=_by()):
        raise UnknownBreakerError(f"no breaker named {name!r} (orchestrator breaker set {name})")
    click.echo(f"breaker {name} removed")
