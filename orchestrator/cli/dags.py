"""``orchestrator dag``: the DAG registry and limits of a DAG across its runs."""

from __future__ import annotations

import json
from typing import Any

import click

from ..core.routing import DEFAULT_TENANT
from . import base
from .base import _by, _dump, _Path


@click.group()
def dag() -> None:
    """The DAG registry (register, versions, show, diff, pause) and limits of a DAG across its
    runs; one tenant's: orchestrator --tenant T dag ... (else tenant `default`)."""


def _dags() -> Any:
    return base._ready_store().dags


@dag.command("register")
@click.argument("spec_file", type=_Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the version as JSON (with created: true|false).")
def dag_register(spec_file: str, as_json: bool) -> None:
    """Register the DAG spec SPEC_FILE under its name: a new version only when its content
    differs from the latest (registering the same content again returns the same version, exit
    0). Validated as a submit is; nothing is stored when it would not submit. Prints `NAME vN`."""
    from ..core.dag import load_spec

    dag_obj = load_spec(spec_file)
    found = base._ready_store().register(dag_obj, by=_by())
    if as_json:
        _dump({**found.to_json(), "created": found.created})
        return
    click.echo(f"{found.name} v{found.version}")
    note = "registered" if found.created else "unchanged: the latest version holds this content"
    click.echo(f"{note} (tenant {found.tenant}, sha256 {found.content_hash[:12]})", err=True)


@dag.command("versions")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"dag": ..., "versions": [...]}.')
def dag_versions(name: str, as_json: bool) -> None:
    """The versions of the registered DAG NAME, oldest first: number, when, by whom, content hash."""
    dags = _dags()
    found = dags.get(name)
    versions = dags.versions(name)
    if as_json:
        _dump({"dag": found.to_json(), "versions": [v.to_json() for v in versions]})
        return
    paused = "  (paused)" if found.paused else ""
    click.echo(f"{found.name}  tenant {found.tenant}  latest v{found.latest_version}{paused}")
    for v in versions:
        when = v.registered_at.isoformat(timespec="seconds") if v.registered_at else "-"
        click.echo(f"v{v.version}  {when}  {v.registered_by or '-'}  sha256 {v.content_hash[:12]}")


@dag.command("show")
@click.argument("name")
@click.option("--version", "version", type=int, default=None, help="This version (default: the latest).")
@click.option("--json", "as_json", is_flag=True, help="Print the version with its spec as JSON.")
def dag_show(name: str, version: int | None, as_json: bool) -> None:
    """Show a version of the registered DAG NAME: its nodes with their tasks and upstream (the
    spec with --json)."""
    dags = _dags()
    found = dags.version(name, version)
    if as_json:
        _dump(found.to_json())
        return
    registered = dags.get(name)
    paused = "  (paused)" if registered.paused else ""
    spec = found.spec or {}
    when = found.registered_at.isoformat(timespec="seconds") if found.registered_at else "-"
    click.echo(
        f"{found.name} v{found.version} of {registered.latest_version}  tenant {found.tenant}{paused}"
        f"  registered {when} by {found.registered_by or '-'}  sha256 {found.content_hash[:12]}"
    )
    if spec.get("params"):
        click.echo(f"params {json.dumps(spec['params'], sort_keys=True)}")
    for node in spec.get("nodes", []):
        upstream = node.get("upstream") or []
        after = f"  after {', '.join(upstream)}" if upstream else ""
        mapped = "  (map)" if node.get("map") else ""
        click.echo(f"  {node.get('key')}  {node.get('task')}{mapped}{after}")


@dag.command("diff")
@click.argument("name")
@click.argument("a", type=int)
@click.argument("b", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the differences as JSON.")
def dag_diff(name: str, a: int, b: int, as_json: bool) -> None:
    """What changed from version A to B of the registered DAG NAME: DAG fields, nodes and edges
    added (+), removed (-) and changed (~, field by field)."""
    found = _dags().diff(name, a, b)
    if as_json:
        _dump(found.to_json())
        return
    for line in found.lines():
        click.echo(line)


@dag.command("pause")
@click.argument("name")
def dag_pause(name: str) -> None:
    """Pause the registered DAG NAME: schedules (and events) start no run of it, their firings
    recorded as skipped; a submit by hand still runs, with a warning."""
    found = _dags().pause(name, by=_by())
    click.echo(f"DAG {found.name} (tenant {found.tenant}) paused: schedules and event triggers start no run of it")


@dag.command("unpause")
@click.argument("name")
def dag_unpause(name: str) -> None:
    """Unpause the registered DAG NAME: its schedules fire again from their next instant."""
    found = _dags().unpause(name, by=_by())
    click.echo(f"DAG {found.name} (tenant {found.tenant}) unpaused")


@dag.command("set")
@click.argument("name")
@click.option("--max-running", type=int, default=None, help="Most tasks QUEUED or RUNNING at once, all runs.")
@click.option("--no-max-running", is_flag=True, help="Remove the DAG's limit.")
def dag_set(name: str, max_running: int | None, no_max_running: bool) -> None:
    """Limit the tasks in flight across every run of the DAG NAME (of the tenant given with
    `orchestrator --tenant T`, else `default`). One run's own limit is the DAG's
    max_active_tasks."""
    if (max_running is None) == (not no_max_running):
        raise click.UsageError("give --max-running N or --no-max-running")
    orc = base._ready_store()
    orc.limits.set_dag_limit(name, None if no_max_running else max_running)
    tenant_now = orc.tenant or DEFAULT_TENANT
    limit_now = orc.limits.dag_limits().get((tenant_now, name))
    click.echo(f"DAG {name} (tenant {tenant_now}): max running {limit_now or 'unlimited'}")


@dag.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"dags": [...]}.')
def dag_list(as_json: bool) -> None:
    """Registered DAGs (latest version, paused) and DAGs with a limit across their runs."""
    orc = base._ready_store()
    registered = {(d.tenant, d.name): d for d in orc.dags.list()}
    limits = orc.limits.dag_limits()
    if orc.tenant is not None:
        limits = {k: v for k, v in limits.items() if k[0] == orc.tenant}
    keys = sorted(set(registered) | set(limits))
    if as_json:
        _dump({
            "dags": [
                {"tenant": t, "name": n, "latest_version": registered[(t, n)].latest_version if (t, n) in registered
                 else None, "paused": bool((t, n) in registered and registered[(t, n)].paused),
                 "max_running": limits.get((t, n))}
                for t, n in keys
            ]
        })  # fmt: skip
        return
    for tenant_name, name in keys:
        found = registered.get((tenant_name, name))
        version = f"  v{found.latest_version}" if found else ""  # a limit alone: not registered
        paused = "  paused" if found and found.paused else ""
        most = limits.get((tenant_name, name))
        limit_text = f"  max running {most}" if most else ""
        click.echo(f"{tenant_name}  {name}{version}{paused}{limit_text}")
