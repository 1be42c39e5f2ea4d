"""An operator's hand on a run and its tasks: ``cancel``, ``retry``, ``skip``, ``clear``, ``mark``,
``rerun`` and ``fail``; the ledger records who acted (``user@host (cli)``)."""

from __future__ import annotations

import click

from . import base
from .base import _by


@click.command()
@click.argument("run_id")
def cancel(run_id: str) -> None:
    """Cancel a run: open tasks become CANCELLED, running ones are revoked.

    The ledger records who acted and from where (`user@host (cli)`). Exits 2 with an `error:` line when the run
    is unknown or already final."""
    revoked = base._ready_store().cancel(run_id, by=_by())
    click.echo(f"run {run_id} cancelled; {revoked} running or queued task(s) revoked")


@click.command()
@click.argument("run_id")
@click.argument("key")
def retry(run_id: str, key: str) -> None:
    """Retry a DEAD_LETTER or FAILED task (attempt + 1).

    Exits 2 with an `error:` line when the task's state does not allow it or another writer
    changed it first (the refused write is in the ledger)."""
    base._ready_store().retry_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} is READY again")


@click.command()
@click.argument("run_id")
@click.argument("key")
def skip(run_id: str, key: str) -> None:
    """Skip a DEAD_LETTER task; its descendants follow their trigger rules (errors as `retry`)."""
    base._ready_store().skip_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} SKIPPED")


@click.command()
@click.argument("run_id")
@click.argument("keys", nargs=-1, required=True)
@click.option("--downstream", is_flag=True, help="Also every task below them.")
@click.option("--upstream", is_flag=True, help="Also every task above them.")
@click.option("--only-failed", is_flag=True, help="Only those FAILED or UPSTREAM_FAILED.")
@click.option("--dry-run", is_flag=True, help="List what would be cleared; write nothing.")
@click.option(
    "--no-setup", "no_setup", is_flag=True,
    help="Not the setups whose scope holds them and their teardowns (cleared with them by default, as in Airflow).",
)  # fmt: skip
def clear(
    run_id: str, keys: tuple[str, ...], downstream: bool, upstream: bool, only_failed: bool, dry_run: bool,
    no_setup: bool,
) -> None:  # fmt: skip
    """Run tasks again: KEYs (and with the flags their descendants / ancestors) go back with
    attempt + 1, each with a ledger row naming who asked; a running attempt among them is fenced
    (its late result refused and recorded) and revoked; a finished run reopens. Exits 2 with an
    `error:` line for an unknown task, a CANCELLED run or nothing to clear. A map is cleared with its
    children; cleared with the task it maps over, it is expanded again (old children removed). As in
    Airflow, a task is cleared with the setups it works under (a setup above it whose teardown is
    below it, or that has none) and their teardowns, unless --no-setup."""
    cleared = base._ready_store().clear(
        run_id, *keys, downstream=downstream, upstream=upstream, only_failed=only_failed, dry_run=dry_run, by=_by(),
        setup=not no_setup,
    )  # fmt: skip
    verb = "would clear" if dry_run else "cleared"
    click.echo(f"{run_id}: {verb} {len(cleared)} task(s): {', '.join(cleared)}")


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--success", "state", flag_value="SUCCEEDED", help="Mark it SUCCEEDED.")
@click.option("--failed", "state", flag_value="FAILED", help="Mark it FAILED.")
@click.option("--skipped", "state", flag_value="SKIPPED", help="Mark it SKIPPED.")
def mark(run_id: str, key: str, state: str | None) -> None:
    """Set a task's outcome by hand (Airflow's Mark Success / Mark Failed): its children follow
    their trigger rules (tasks its old outcome had decided without running are decided again); a
    running attempt is fenced and revoked. Exits 2 with an `error:` line as `clear`."""
    if state is None:
        raise click.UsageError("say --success, --failed or --skipped")
    held = base._ready_store().mark(run_id, key, state, by=_by())
    click.echo(f"{run_id}.{key}: {held.value} -> {state}")


@click.command()
@click.argument("run_id")
def rerun(run_id: str) -> None:
    """A new run of RUN_ID's DAG snapshot and params, for its tenant, linked to it (`rerun_of`);
    prints the new run's id."""
    handle = base._ready_store().rerun(run_id)
    click.echo(handle.id)


@click.command(name="fail")
@click.argument("run_id")
@click.argument("key")
def fail_task(run_id: str, key: str) -> None:
    """Give up on a DEAD_LETTER task: it becomes FAILED and its descendants follow (errors as `retry`)."""
    base._ready_store().fail_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} FAILED")
