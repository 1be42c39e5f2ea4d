"""``orchestrator on``: event triggers, each matching event starting one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from . import base
from .base import _batch_option, _dump, _json_object, _Path

if TYPE_CHECKING:
    from ..services.triggers import Triggers


def _triggers() -> Triggers:
    return base._ready_store().triggers


@click.group()
def on() -> None:
    """Event triggers (stored in the database): each event of a key whose payload matches
    starts one run.

    A trigger names an event key, an optional match (a JSON object the payload must contain) and
    what to run (a spec file, snapshotted when added, a DAG factory module:function(logical_date,
    params), or a registered DAG NAME[@N]); the event's payload is laid over the params. One run
    per (trigger, event) however many emitters and beats run; `orchestrator beat` finishes what
    an emitter left (and what waits for --max-active-runs)."""


@on.command("add")
@click.argument("name")
@click.option("--event", "event", required=True, help="The event key that starts it.")
@click.option("--match", default=None, metavar="JSON", help="A JSON object the event's payload must contain.")
@click.option("--spec", "spec_file", default=None, help="A DAG spec file (YAML/JSON), snapshotted now.")
@click.option(
    "--dag", "factory", default=None, metavar="FACTORY|SPEC",
    help="Or: a factory module:function(logical_date, params) -> DAG, or a spec file.",
)  # fmt: skip
@click.option(
    "--registered", default=None, metavar="NAME[@N]",
    help="Or: a DAG of the registry (orchestrator dag register): its latest version when it fires, or N.",
)  # fmt: skip
@click.option("--params", default=None, metavar="JSON", help="JSON object: params under the event's payload.")
@click.option("--max-active-runs", type=int, default=None, help="Most runs of the trigger running at once.")
@click.option(
    "--batch", default=None, metavar="N,WINDOW",
    help="Gather events: up to N, or WINDOW (5s, 2m) from the first, make one run (its 'events' param lists them).",
)  # fmt: skip
@click.option(
    "--paused/--no-paused",
    default=None,
    help="Add it paused (--no-paused: active); by default a new trigger is active and a replaced one keeps its flag.",
)
def on_add(
    name: str, event: str, match: str | None, spec_file: str | None, factory: str | None, registered: str | None,
    params: str | None, max_active_runs: int | None, batch: str | None, paused: bool | None,
) -> None:  # fmt: skip
    """Add the event trigger NAME, or replace its definition. --dag takes a factory
    module:function or, as --spec does, a spec file (a path ending .yaml, .yml or .json)."""
    if (
        factory is not None
        and spec_file is None
        and (factory.endswith((".yaml", ".yml", ".json")) or Path(factory).is_file())
    ):
        spec_file, factory = factory, None
    found = _triggers().add(
        name, event=event, match=_json_object(match, "--match"), spec=spec_file, dag=factory, registered=registered,
        params=_json_object(params, "--params"), max_active_runs=max_active_runs, paused=paused,
        batch=_batch_option(batch),
    )  # fmt: skip
    state = "paused" if found.paused else "active"
    click.echo(f"trigger {name}: on {found.event}, {found.what}; {state}")


@on.command("apply")
@click.argument("file", type=_Path(dir_okay=False))
def on_apply(file: str) -> None:
    """Upsert every trigger of FILE (YAML/JSON: {"triggers": [{name, event, match,
    spec|dag|registered, params, max_active_runs, batch, paused}]}; a spec path is relative to FILE).
    Every entry is checked before any is written."""
    for found in _triggers().apply(file):
        click.echo(f"trigger {found.name}: on {found.event}, {found.what}")


@on.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"triggers": [...]}.')
def on_list(as_json: bool) -> None:
    """Every event trigger: its event and match, what it runs, paused, last run, last error."""
    found = [t.to_json() for t in _triggers().all()]
    if as_json:
        _dump({"triggers": found})
        return
    for v in found:
        match = f" match {json.dumps(v['match'], sort_keys=True)}" if v["match"] else ""
        state = "paused" if v["paused"] else "active"
        last = f"last {v['last_run']} {v['last_run_state'] or ''}".rstrip() if v["last_run"] else "never fired"
        error = f"  error: {v['last_error']}" if v["last_error"] else ""
        click.echo(f"{v['name']}  on {v['event']}{match}  {v['runs']}  {state}  {last}{error}")


@on.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"trigger": {...}, "firings": [...]}.')
@click.option("--limit", default=20, show_default=True, help="This many newest firings.")
def on_show(name: str, as_json: bool, limit: int) -> None:
    """A trigger and its newest firings: fired (with the run), waiting, skipped, failed (with why)."""
    triggers = _triggers()
    found = triggers.get(name)
    firings = [
        {
            "event_id": f.event_id,
            "emitted_at": f.emitted_at.isoformat() if f.emitted_at is not None else None,
            "state": f.state,
            "run_id": f.run_id,
            "reason": f.reason,
            "dag_version": f.dag_version,
        }
        for f in triggers.firings(name, limit)
    ]
    if as_json:
        _dump({"trigger": found.to_json(), "firings": firings})
        return
    for field, value in found.to_json().items():
        if value is None or value == {}:
            continue
        shown = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, bool)) else value
        click.echo(f"{field + ':':<17} {shown}")
    click.echo(f"firings ({len(firings)}, newest first):" if firings else "firings: none yet")
    for f in firings:
        version = f" v{f['dag_version']}" if f["dag_version"] is not None else ""
        click.echo(f"{f['event_id'] or '-'}  {f['state']:<8} {f['run_id'] or ''}{version}  {f['reason'] or ''}")


@on.command("pause")
@click.argument("name")
def on_pause(name: str) -> None:
    """Pause NAME: events emitted while it is paused start nothing (they are not replayed)."""
    _triggers().pause(name)
    click.echo(f"trigger {name} paused")


@on.command("resume")
@click.argument("name")
def on_resume(name: str) -> None:
    """Resume NAME: the next matching event starts a run."""
    _triggers().resume(name)
    click.echo(f"trigger {name} resumed")


@on.command("remove")
@click.argument("name")
def on_remove(name: str) -> None:
    """Remove NAME and its firings (its runs stay)."""
    _triggers().remove(name)
    click.echo(f"trigger {name} removed")
