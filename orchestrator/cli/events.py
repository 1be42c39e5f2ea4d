"""What a WAITING task waits for, from outside: ``emit`` (events), ``signal``, ``approve`` and ``reject``."""

from __future__ import annotations

import json
from typing import Any

import click

from . import base
from .base import _by, _json_object


def _emitted_line(done: Any) -> str:
    if done.duplicate:
        return f"event {done.event_id}: duplicate, ignored"
    return f"event {done.event_id}: woke {done.woken} task(s)"


@click.command()
@click.argument("key")
@click.option("--payload", default=None, metavar="JSON", help="The event's payload: a JSON object (default {}).")
@click.option(
    "--event-id", default=None,
    help="De-duplication id: a second emit with it, the same key and payload, is ignored; with another key or"
    " payload it is refused (default: new).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help='Print {"id", "event_id", "duplicate", "woken"}.')
def emit(key: str, payload: str | None, event_id: str | None, as_json: bool) -> None:
    """Emit the event KEY for the tenant (--tenant, before the command): every task WAITING for
    KEY whose match the payload contains wakes, and every event trigger on KEY whose match it
    contains starts a run."""
    done = base._ready_store().events.emit(key, _json_object(payload, "--payload"), event_id=event_id, by=_by())
    if as_json:
        click.echo(
            json.dumps({"id": done.id, "event_id": done.event_id, "duplicate": done.duplicate, "woken": done.woken})
        )
    else:
        click.echo(_emitted_line(done))


@click.command()
@click.argument("run_id")
@click.argument("name")
@click.option("--payload", default=None, metavar="JSON", help="The signal's payload: a JSON object (default {}).")
@click.option(
    "--event-id", default=None,
    help="De-duplication id: a second signal with it, the same name and payload, is ignored; else refused.",
)  # fmt: skip
def signal(run_id: str, name: str, payload: str | None, event_id: str | None) -> None:
    """Send the signal NAME to the run RUN_ID: its tasks WAITING for NAME wake (a task that
    begins to wait for it later finds it). A signal never starts a run."""
    done = base._ready_store().events.signal(
        run_id, name, _json_object(payload, "--payload"), event_id=event_id, by=_by()
    )
    click.echo(_emitted_line(done).replace("event", "signal", 1))


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--comment", default=None, help="Why (kept with the answer).")
def approve(run_id: str, key: str, comment: str | None) -> None:
    """Approve the approval node KEY of run RUN_ID (it must be WAITING for an approval): it
    succeeds, recorded with who approved."""
    base._ready_store().approve(run_id, key, by=_by(), comment=comment)
    click.echo(f"{run_id}.{key} approved")


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--comment", default=None, help="Why (kept with the answer).")
def reject(run_id: str, key: str, comment: str | None) -> None:
    """Reject the approval node KEY of run RUN_ID: it fails (Rejected), its downstream follows
    its trigger rules."""
    base._ready_store().reject(run_id, key, by=_by(), comment=comment)
    click.echo(f"{run_id}.{key} rejected")
