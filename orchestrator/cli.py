"""The ``orchestrator`` command line."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .errors import OrchestratorError


def _orc() -> Any:
    from . import default

    return default()


def _engine() -> Any:
    """An engine on the configured database without the schema check (for `db` commands)."""
    from .config import Settings
    from .store import make_engine

    return make_engine(Settings.from_env().database_url)


def _dump(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


class _Group(click.Group):
    """Print orchestrator errors as one line on stderr, exit 2, no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        import sqlalchemy as sa

        try:
            return super().invoke(ctx)
        except OrchestratorError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except sa.exc.DBAPIError as exc:
            # unreachable or misconfigured database: the driver's first line (never the URL's password)
            first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
            click.echo(f"error: database: {first}", err=True)
            sys.exit(2)
        except sa.exc.ArgumentError as exc:
            click.echo(f"error: database URL: {exc}", err=True)
            sys.exit(2)


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
    embedded default (SQLite + a file-based broker under ./.orchestrator) is used.
    """
    if as_tenant is not None:
        import os

        os.environ["ORCHESTRATOR_TENANT"] = as_tenant


@main.command()
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to follow the run.")
def demo(timeout: float) -> None:
    """Run a small ETL DAG with an in-process worker on the embedded default."""
    from .demo import run_demo

    sys.exit(run_demo(timeout=timeout))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def worker(ctx: click.Context) -> None:
    """Start a Celery worker of the project's app; options go to `celery worker`.

    Without -Q it consumes every queue the orchestrator routes to by default. `--tenant NAME`
    (this command's own option) consumes only that tenant's dedicated queues
    (orchestrator.tenant.NAME.high/default/low: see `orchestrator tenant set NAME --dedicated`).
    Beside its pool the worker's main process keeps its capacity registered and runs the
    reconciler service (one worker on duty at a time across the deployment;
    ORCHESTRATOR_WORKER_RECONCILER=0 to turn it off), so a deployment of workers alone retries
    and recovers.
    """
    from .celery_app import get_app

    get_app().worker_main(argv=["worker", *worker_argv(list(ctx.args))])


def worker_argv(args: list[str]) -> list[str]:
    """``celery worker`` options from ``orchestrator worker``'s: ``--tenant NAME`` (or
    ``--tenant=NAME``) becomes ``-Q`` with that tenant's dedicated queues."""
    from .dag import TENANT_RE
    from .errors import ValidationError
    from .routing import tenant_queues

    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--tenant" or arg.startswith("--tenant="):
            if arg == "--tenant":
                if i + 1 >= len(args):
                    raise ValidationError("--tenant needs a tenant name")
                name, i = args[i + 1], i + 2
            else:
                name, i = arg.split("=", 1)[1], i + 1
            if not TENANT_RE.fullmatch(name):
                raise ValidationError(f"tenant {name!r} must be 1-64 letters, digits, '_' or '-'")
            out += ["-Q", ",".join(tenant_queues(name))]
            continue
        out.append(arg)
        i += 1
    return out


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def beat(ctx: click.Context) -> None:
    """Start celery beat with the project's app; options go to `celery beat`.

    Beat is not needed for retries or recovery: the reconciler runs in the workers.
    """
    from .celery_app import get_app

    get_app().start(argv=["beat", *ctx.args])


@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command()
@click.argument("revision", default="head")
def upgrade(revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    from . import migrate

    engine = _engine()
    migrate.upgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
@click.argument("revision")
def downgrade(revision: str) -> None:
    """Migrate the database down to REVISION ("base" drops every table)."""
    from . import migrate

    engine = _engine()
    migrate.downgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
def current() -> None:
    """Print the database's revision and the newest one."""
    from . import migrate

    click.echo(f"current: {migrate.current(_engine())}  head: {migrate.head()}")


@db.command()
def check() -> None:
    """Exit 1 unless the database is at head and matches the declared schema exactly."""
    from . import migrate

    engine = _engine()
    at, head = migrate.current(engine), migrate.head()
    diff = migrate.schema_diff(engine)
    if at != head or diff:
        click.echo(f"schema mismatch: revision {at} (head {head})", err=True)
        for item in diff:
            click.echo(f"  {item}", err=True)
        sys.exit(1)
    click.echo(f"schema matches orchestrator/schema.py at revision {head}")


def _ready_store() -> Any:
    orc = _orc()
    orc.store  # noqa: B018 - migrates the embedded default, checks any other schema
    return orc


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--tenant", help="Run for this tenant instead of the spec's.")
@click.option("--idempotency-key", help="Submitting the same key again returns the same run.")
@click.option("--wait", "wait_", is_flag=True, help="Follow the run; exit 0 only if it SUCCEEDED.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
def submit(file: str, tenant: str | None, idempotency_key: str | None, wait_: bool, timeout: float | None) -> None:
    """Submit the DAG spec FILE (YAML or JSON); prints the run id first."""
    from .dag import load_spec
    from .demo import follow, format_tasks

    dag = load_spec(file)
    orc = _ready_store()
    run = orc.submit(dag, tenant=tenant, idempotency_key=idempotency_key)
    click.echo(run.id)
    if not wait_:
        return
    state = follow(run, lambda line: click.echo(line, err=True), timeout or float("inf"))
    click.echo(format_tasks(run.tasks()), err=True)
    click.echo(state.value)
    sys.exit(0 if state.value == "SUCCEEDED" else 1)


@main.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {run, tasks}.")
def status(run_id: str, as_json: bool) -> None:
    """Show a run and its tasks."""
    from .demo import format_tasks

    orc = _ready_store()
    view = orc.visible(run_id)
    tasks = orc.store.reads.get_tasks(run_id)
    if as_json:
        _dump({"run": view.to_json(), "tasks": [t.to_json() for t in tasks]})
        return
    attention = "  (needs attention)" if view.needs_attention else ""
    click.echo(f"run {view.id}  dag {view.dag}  tenant {view.tenant}  state {view.state.value}{attention}")
    click.echo(format_tasks(tasks))


@main.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"runs": [...]}.')
@click.option("--limit", default=20, show_default=True)
@click.option("--tenant", default=None)
def runs(as_json: bool, limit: int, tenant: str | None) -> None:
    """List recent runs, newest first."""
    views = _ready_store().runs(limit, tenant=tenant)
    if as_json:
        _dump({"runs": [v.to_json() for v in views]})
        return
    for v in views:
        created = v.created_at.isoformat(timespec="seconds") if v.created_at else "-"
        attention = "  (needs attention)" if v.needs_attention else ""
        click.echo(
            f"{v.id}  {v.state.value:<9}  {v.dag}  tenant={v.tenant}  tasks={v.task_count}  {created}{attention}"
        )


@main.command()
@click.option("--once", is_flag=True, help="Run one pass and exit (default: loop every ORCHESTRATOR_TICK_SECONDS).")
@click.option("--interval", type=float, default=None, help="Seconds between passes (default: tick_seconds).")
@click.option("--name", default=None, help="Name shown for this reconciler (default: reconcile@HOST:PID).")
def reconcile(once: bool, interval: float | None, name: str | None) -> None:
    """Run the reconciler as a service: release due retries, re-publish lost dispatches,
    expire leases, dispatch free capacity and close finished runs.

    Every worker already runs one; this command is for deployments that want it apart from
    the workers. Only one reconciler is on duty at a time across the deployment (a Postgres
    advisory lock); the others wait and print nothing. Prints one line of counts per pass.
    """
    import os
    import socket

    from .reconciler import ReconcilerService

    orc = _ready_store()
    service = ReconcilerService(
        orc.reconciler,
        name=name or f"reconcile@{socket.gethostname()}:{os.getpid()}",
        interval=interval or orc.settings.tick_seconds,
        stall_seconds=orc.settings.reconciler_stall_seconds,
    )
    if once:
        click.echo(" ".join(f"{k}={v}" for k, v in orc.reconcile().items()))
        return
    service.run(echo=lambda report: click.echo(" ".join(f"{k}={v}" for k, v in report.items())))


@main.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help='Print {"events": [...]}.')
def events(run_id: str, as_json: bool) -> None:
    """Show the ledger of a run: every transition, accepted or rejected."""
    orc = _ready_store()
    orc.visible(run_id)
    rows = orc.store.reads.events(run_id)
    if as_json:
        _dump({"events": [e.to_json() for e in rows]})
        return
    for e in rows:
        mark = " " if e.accepted else "x"
        at = e.at.isoformat(timespec="milliseconds") if e.at else "-"
        reason = f"  {e.reason}" if e.reason else ""
        who = f"{e.actor} ({e.by})" if e.by else e.actor
        what = "run" if e.key is None else f"{e.key}#{e.attempt}"
        click.echo(f"{at} {mark} {what} {e.from_state or '-'} -> {e.to_state} by {who}{reason}")


@main.group()
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
    orc = _ready_store()
    if weight is None and max_running is None and not no_max_running and dedicated is None:
        raise click.UsageError("give --weight, --max-running, --no-max-running, --dedicated or --shared")
    if dedicated is not None:
        orc.set_tenant_dedicated(name, dedicated)
    if weight is not None:
        orc.set_tenant_weight(name, weight)
    if max_running is not None or no_max_running:
        orc.set_tenant_limit(name, None if no_max_running else max_running)
    weight_now, limit_now, dedicated_now = orc.tenant_settings().get(name, (1.0, None, False))
    queues = "dedicated queues" if dedicated_now else "shared queues"
    click.echo(f"tenant {name}: weight {weight_now:g}, max running {limit_now or 'unlimited'}, {queues}")


@tenant.command("list")
def tenant_list() -> None:
    """Tenants with settings (every other tenant weighs 1 and has no limit)."""
    for name, (weight, limit, dedicated) in sorted(_ready_store().tenant_settings().items()):
        queues = "dedicated" if dedicated else "shared"
        click.echo(f"{name}  weight {weight:g}  max running {limit or 'unlimited'}  queues {queues}")


@main.group()
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
    orc = _ready_store()
    orc.set_pool(name, slots, description)
    found = next(p for p in orc.pools() if p.name == name)
    click.echo(f"pool {name}: {found.slots} slot(s), {found.used} in use")


@pool.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"pools": [{"name", "slots", "used", "description"}]}.')
def pool_list(as_json: bool) -> None:
    """Every pool with its slots and how many are in use now."""
    pools = _ready_store().pools()
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
    if not _ready_store().remove_pool(name):
        raise click.ClickException(f"no pool named {name!r}")
    click.echo(f"pool {name} removed")


@main.group()
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
    found = _ready_store().set_rate_limit(key, rate, burst)
    click.echo(f"rate limit {key}: {found.rate_text}, burst {found.burst}")


@limit.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"rate_limits": [{"key", "rate", "burst", "tokens"}]}.')
def limit_list(as_json: bool) -> None:
    """Every rate limit with its rate, burst and the tokens in its bucket now."""
    found = _ready_store().rate_limits()
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
    if not _ready_store().remove_rate_limit(key):
        raise click.ClickException(f"no rate limit named {key!r}")
    click.echo(f"rate limit {key} removed")


@main.group()
def dag() -> None:
    """Limits of a DAG across its runs (one tenant's: orchestrator --tenant T dag ...)."""


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
    orc = _ready_store()
    orc.set_dag_limit(name, None if no_max_running else max_running)
    tenant_now = orc.tenant or "default"
    limit_now = orc.dag_limits().get((tenant_now, name))
    click.echo(f"DAG {name} (tenant {tenant_now}): max running {limit_now or 'unlimited'}")


@dag.command("list")
def dag_list() -> None:
    """DAGs with a limit across their runs."""
    for (tenant_name, name), most in sorted(_ready_store().dag_limits().items()):
        click.echo(f"{tenant_name}  {name}  max running {most}")


@main.command()
@click.argument("run_id")
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help='Print {"tasks": [{"key", "state", "reasons": [...]}]}.')
@click.option("--all", "show_all", is_flag=True, help="Also list running and finished tasks.")
def explain(run_id: str, key: str | None, as_json: bool, show_all: bool) -> None:
    """Why isn't it running? For every task of the run that is not running or finished (or
    only KEY), the reasons: parents it waits on, its trigger rule so far, a parent parked in
    DEAD_LETTER, a limit used up (the tenant's, the run's max_active_tasks, the DAG's: held by
    which runs), its pool full (held by which tasks) or missing, its rate limit out of tokens
    (the next at T) or missing, other tenants further below their fair share going first,
    READY behind N tasks of higher or equal priority, every worker
    slot in use, no live worker for its queue, waiting in the broker, a retry's backoff, the
    run cancelled."""
    found = _ready_store().explain(run_id, key)
    if key is None and not show_all:
        found = [e for e in found if e.reasons and e.reasons[0].kind not in ("running", "finished")]
    if as_json:
        _dump({"run": run_id, "tasks": [e.to_json() for e in found]})
        return
    if not found:
        click.echo("every task is running or finished")
    for e in found:
        click.echo(f"{e.key}  {e.state.value}")
        for r in e.reasons:
            click.echo(f"  - {r.kind}: {r.detail}")


@main.command()
@click.argument("run_ids", nargs=-1)
@click.option("--limit", default=1000, show_default=True, help="Without RUN_IDs: this many newest runs.")
def verify(run_ids: tuple[str, ...], limit: int) -> None:
    """Check the promise from the database alone, for the given runs or the newest ones.

    Every accepted transition legal, at most one accepted result per task (exactly one for a
    SUCCEEDED task, of the row's attempt), attempts never going back, parents finished before
    their children started, every final run's tasks terminal (DEAD_LETTER allowed: it waits
    for a person) and its ledger ending in its state. Prints each violation and exits 1 if there
    is any; prints a summary and exits 0 otherwise.
    """
    from .invariants import check_runs

    orc = _ready_store()
    ids = [orc.visible(r).id for r in run_ids] if run_ids else [v.id for v in orc.runs(limit)]
    problems = check_runs(orc.store, ids, allow_dead_letter=True, in_progress_ok=True)
    for line in problems:
        click.echo(f"violation: {line}")
    if problems:
        click.echo(f"{len(problems)} violation(s) in {len(ids)} run(s)", err=True)
        sys.exit(1)
    click.echo(f"{len(ids)} run(s) checked: no violation")


@main.command()
@click.argument("run_id")
def cancel(run_id: str) -> None:
    """Cancel a run: open tasks become CANCELLED, running ones are revoked.

    The ledger records the OS user as who acted. Exits 2 with an `error:` line when the run
    is unknown or already final."""
    revoked = _ready_store().cancel(run_id)
    click.echo(f"run {run_id} cancelled; {revoked} running or queued task(s) revoked")


@main.command()
@click.argument("run_id")
@click.argument("key")
def retry(run_id: str, key: str) -> None:
    """Retry a DEAD_LETTER or FAILED task (attempt + 1).

    Exits 2 with an `error:` line when the task's state does not allow it or another writer
    changed it first (the refused write is in the ledger)."""
    _ready_store().retry_task(run_id, key)
    click.echo(f"{run_id}.{key} is READY again")


@main.command()
@click.argument("run_id")
@click.argument("key")
def skip(run_id: str, key: str) -> None:
    """Skip a DEAD_LETTER task; its descendants follow their trigger rules (errors as `retry`)."""
    _ready_store().skip_task(run_id, key)
    click.echo(f"{run_id}.{key} SKIPPED")


@main.command(name="fail")
@click.argument("run_id")
@click.argument("key")
def fail_task(run_id: str, key: str) -> None:
    """Give up on a DEAD_LETTER task: it becomes FAILED and its descendants follow (errors as `retry`)."""
    _ready_store().fail_task(run_id, key)
    click.echo(f"{run_id}.{key} FAILED")


@main.command()
@click.option(
    "--runs", default=100, show_default=True, help="At least this many DAG runs (more while faults are owed)."
)
@click.option("--seed", default=1, show_default=True, help="Random seed of the DAGs and of the fault sequence.")
@click.option("--workers", default=2, show_default=True, help="Prefork worker processes (-c 2 each).")
@click.option("--min-faults", default=200, show_default=True, help="Keep injecting until this many faults.")
@click.option("--database-url", envvar="ORCHESTRATOR_CHAOS_DATABASE_URL",
              default="postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_chaos", show_default=True,
              help="A Postgres database the soak may wipe.")  # fmt: skip
@click.option("--timeout", default=900.0, show_default=True, help="Give up after this many seconds.")
def chaos(runs: int, seed: int, workers: int, min_faults: int, database_url: str, timeout: float) -> None:
    """Soak a local deployment (private Redis, real workers, reconciler) under random faults.

    Exits 1 if any invariant broke: a task lost, stuck or committed twice, an illegal
    transition, a child started before its parent. The database is wiped first.
    """
    from .chaos import run_chaos

    sys.exit(run_chaos(runs=runs, seed=seed, database_url=database_url, workers=workers,
                       min_faults=min_faults, timeout=timeout))  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    main()
