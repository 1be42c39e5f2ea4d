"""``orchestrator schedule`` (cron and interval schedules) and ``orchestrator backfill``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from . import base
from .base import _dump, _json_text, _Path

if TYPE_CHECKING:
    from ..services.scheduling import Schedules


def _schedules() -> Schedules:
    return base._ready_store().schedules


def _when(value: str | None) -> str:
    return value or "-"


@click.group()
def schedule() -> None:
    """Cron and interval schedules (stored in the database; fired by `orchestrator beat`).

    A schedule names what to run (a spec file, snapshotted when added, a DAG factory
    module:function(logical_date, params), or a registered DAG NAME[@N]) and when: a cron
    expression in an IANA time zone with a DST policy, or every N seconds. Each firing is an
    ordinary run whose logical date is the scheduled instant, one run per instant however many
    beats run."""


@schedule.command("add")
@click.argument("name")
@click.option("--cron", default=None, help='A 5-field cron expression, e.g. "30 2 * * *".')
@click.option("--every", type=float, default=None, help="Or: every this many seconds (absolute time).")
@click.option("--tz", default="UTC", show_default=True, help="IANA time zone of the cron expression.")
@click.option("--spec", "spec_file", default=None, help="A DAG spec file (YAML/JSON), snapshotted now.")
@click.option("--dag", "factory", default=None, help="Or: a factory module:function(logical_date, params) -> DAG.")
@click.option(
    "--registered", default=None, metavar="NAME[@N]",
    help="Or: a DAG of the registry (orchestrator dag register): its latest version when it fires, or N.",
)  # fmt: skip
@click.option("--params", default=None, help="JSON object: the factory's params / the spec's params.")
@click.option(
    "--dst-gap",
    type=click.Choice(["shift", "skip"]),
    default="shift",
    show_default=True,
    help="A local time that does not exist (spring forward): fire at PEP 495's fold=0 instant, or skip.",
)
@click.option(
    "--dst-fold",
    type=click.Choice(["first", "last", "both"]),
    default="first",
    show_default=True,
    help="A local time that happens twice (fall back): fire at the first, the last, or both.",
)
@click.option(
    "--catchup",
    type=click.Choice(["none", "latest", "all"]),
    default="latest",
    show_default=True,
    help="Instants missed while beat was down or the schedule paused.",
)
@click.option("--max-catchup", type=int, default=10, show_default=True, help="With --catchup all: at most this many.")
@click.option(
    "--overlap",
    type=click.Choice(["allow", "skip", "buffer_one", "cancel_previous"]),
    default="allow",
    show_default=True,
    help="When the previous run of the schedule is still running.",
)
@click.option("--max-active-runs", type=int, default=None, help="Most runs of the schedule running at once.")
@click.option(
    "--paused/--no-paused",
    default=None,
    help="Add it paused (--no-paused: firing); by default a new schedule fires and a replaced one keeps its flag.",
)
def schedule_add(
    name: str, cron: str | None, every: float | None, tz: str, spec_file: str | None, factory: str | None,
    registered: str | None, params: str | None, dst_gap: str, dst_fold: str, catchup: str, max_catchup: int,
    overlap: str, max_active_runs: int | None, paused: bool | None,
) -> None:  # fmt: skip
    """Add the schedule NAME, or replace its definition (its place is kept if its timing is
    the same)."""
    from ..core.cron import ScheduleError
    from ..core.errors import ValidationError

    try:
        parsed = _json_text(params, "--params") if params is not None else None
    except ValidationError as exc:
        raise ScheduleError(str(exc)) from None
    found = _schedules().add(
        name, cron=cron, every=every, tz=tz, spec=spec_file, dag=factory, registered=registered, params=parsed,
        dst_gap=dst_gap,
        dst_fold=dst_fold, catchup=catchup, max_catchup=max_catchup, overlap=overlap,
        max_active_runs=max_active_runs, paused=paused,
    )  # fmt: skip
    view = found.to_json()
    click.echo(f"schedule {name}: {found.timing.describe()}, {found.what}; next {_when(view['next_fire'])}")


@schedule.command("apply")
@click.argument("file", type=_Path(dir_okay=False))
def schedule_apply(file: str) -> None:
    """Upsert every schedule of FILE (YAML/JSON: {"schedules": [{name, cron|every, tz,
    spec|dag|registered, params, dst_gap, dst_fold, catchup, max_catchup, overlap, max_active_runs, paused}]}; a spec
    path is relative to FILE). Every entry is checked before any is written."""
    for found in _schedules().apply(file):
        click.echo(f"schedule {found.name}: {found.timing.describe()}, {found.what}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"schedules": [...]}.')
def schedule_list(as_json: bool) -> None:
    """Every schedule: timing, paused, next fire (UTC and local), last run and its state, last error."""
    found = [s.to_json() for s in _schedules().all()]
    if as_json:
        _dump({"schedules": found})
        return
    for v in found:
        when = f"cron {v['cron']!r} {v['tz']}" if v["cron"] else f"every {v['every']:g}s"
        state = "paused" if v["paused"] else f"next {v['next_fire']} ({v['next_fire_local']})"
        last = f"last {v['last_run']} {v['last_run_state'] or ''}".rstrip() if v["last_run"] else "never fired"
        error = f"  error: {v['last_error']}" if v["last_error"] else ""
        click.echo(f"{v['name']}  {when}  {state}  {last}{error}")


@schedule.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"schedule": {...}, "firings": [...]}.')
@click.option("--limit", default=20, show_default=True, help="This many newest firings.")
def schedule_show(name: str, as_json: bool, limit: int) -> None:
    """A schedule and its newest firings: fired (with the run), skipped (with why), failed."""
    sched = _schedules()
    found = sched.get(name)
    firings = [
        {
            "logical_date": f.logical_date.isoformat() if hasattr(f.logical_date, "isoformat") else f.logical_date,
            "state": f.state,
            "kind": f.kind,
            "run_id": f.run_id,
            "reason": f.reason,
            "dag_version": f.dag_version,
        }
        for f in sched.firings(name, limit)
    ]
    if as_json:
        _dump({"schedule": found.to_json(), "firings": firings})
        return
    for field, value in found.to_json().items():
        if value is None or value == {}:
            continue
        shown = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, bool)) else value
        click.echo(f"{field + ':':<17} {shown}")
    click.echo(f"firings ({len(firings)}, newest first):" if firings else "firings: none yet")
    for f in firings:
        version = f" v{f['dag_version']}" if f["dag_version"] is not None else ""
        click.echo(
            f"{f['logical_date']}  {f['state']:<8} {f['kind']:<9} {f['run_id'] or ''}{version}  {f['reason'] or ''}"
        )


@schedule.command("pause")
@click.argument("name")
def schedule_pause(name: str) -> None:
    """Stop firing NAME (beat keeps running; missed instants go through --catchup on resume)."""
    _schedules().pause(name)
    click.echo(f"schedule {name} paused")


@schedule.command("resume")
@click.argument("name")
def schedule_resume(name: str) -> None:
    """Fire NAME again; the instants missed while paused go through its catch-up policy."""
    found = _schedules().resume(name)
    click.echo(f"schedule {name} resumed; next {found.to_json()['next_fire']}")


@schedule.command("trigger")
@click.argument("name")
def schedule_trigger(name: str) -> None:
    """A manual run of NAME now (logical date = now), paused or not. Prints the run id."""
    fired = _schedules().trigger(name)
    if fired.error:
        raise click.ClickException(f"schedule {name} could not fire: {fired.error}")
    click.echo(fired.run_id)


@schedule.command("remove")
@click.argument("name")
def schedule_remove(name: str) -> None:
    """Remove NAME and its firings (its runs stay)."""
    _schedules().remove(name)
    click.echo(f"schedule {name} removed")


def _instant(text: str, zone: Any, what: str) -> Any:
    """A backfill bound: a date (midnight in the schedule's zone) or an ISO date-time (naive:
    in the schedule's zone)."""
    import datetime as dt

    from ..core.cron import ScheduleError

    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ScheduleError(f"{what} {text!r} is not an ISO date (2026-03-01) or date-time") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=zone)


@click.command()
@click.argument("name")
@click.option(
    "--start", required=True, help="First instant (inclusive): a date or ISO date-time, in the schedule's zone."
)
@click.option("--end", required=True, help="End (exclusive), the same way.")
@click.option("--max-active", default=4, show_default=True, help="Most runs of the schedule running at once.")
@click.option("--wait", "wait_", is_flag=True, help="Then wait until every run is final; exit 1 unless all succeeded.")
@click.option("--dry-run", is_flag=True, help="Print the logical dates it would create; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (the default when not on a terminal).")
def backfill(name: str, start: str, end: str, max_active: int, wait_: bool, dry_run: bool, as_json: bool) -> None:
    """Create a run for every instant of schedule NAME in [START, END) that has none, oldest
    first, at most --max-active running at once. Idempotent with beat and with itself: kill it
    at any point and run it again; it creates only what is missing."""
    from ..store.schedules import iso

    sched = _schedules()
    current = sched.get(name)
    zone = current.timing.zone
    lo, hi = _instant(start, zone, "--start"), _instant(end, zone, "--end")
    if dry_run:
        dates = [iso(d) for d in sched.backfill_dates(name, lo, hi)]
        if as_json:
            click.echo(json.dumps({"logical_dates": dates}))
        else:
            for d in dates:
                click.echo(d)
        return
    total = len(sched.backfill_dates(name, lo, hi))
    lines = as_json or not sys.stdout.isatty()
    created = existing = failed = 0
    runs: list[str] = []
    bar = None if lines else click.progressbar(length=total, label=f"backfill {name}", show_pos=True)
    try:
        if bar is not None:
            bar.__enter__()
        for fired in sched.backfill(name, lo, hi, max_active=max_active):
            created += fired.created
            existing += fired.run_id is not None and not fired.created
            failed += fired.error is not None
            if fired.run_id:
                runs.append(fired.run_id)
            if lines:
                click.echo(json.dumps({
                    "logical_date": fired.logical_date.isoformat(), "run_id": fired.run_id,
                    "created": fired.created, "error": fired.error,
                }))  # fmt: skip
            elif bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    summary = {"instants": total, "created": created, "existing": existing, "failed": failed}
    if wait_:
        states = [base._ready_store().run(r).wait(None).state.value for r in runs]
        summary["succeeded"] = states.count("SUCCEEDED")
    if lines:
        click.echo(json.dumps({"summary": summary}))
    else:
        click.echo(", ".join(f"{k} {v}" for k, v in summary.items()))
    if failed or (wait_ and summary["succeeded"] != len(runs)):
        sys.exit(1)
