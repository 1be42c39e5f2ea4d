"""The ``orchestrator`` command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..core.errors import OrchestratorError

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator
    from ..services.scheduling import Schedules
    from ..services.triggers import Triggers


def _orc() -> Orchestrator:
    from ..runtime.celery_app import default_orchestrator

    return default_orchestrator()


def _engine() -> Any:
    """An engine on the configured database without the schema check (for `db` commands)."""
    from ..core.config import Settings
    from ..store import make_engine

    return make_engine(Settings.from_env().database_url)


def _by() -> str:
    """Who acts through the CLI, and from where, as the ledger records it: ``user@host (cli)``."""
    from ..engine.facade import local_by

    return local_by("cli")


def _dump(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def state_text(task: Any) -> str:
    """A task's state as the task tables print it: a SKIPPED task with its reason
    (``SKIPPED (branch_not_taken)``), a mapped node with its children counted (``MAPPED 7/10
    done: 6 ok, 1 failed, 0 skipped``), a map's child with its item (``SUCCEEDED (item 3 of
    resize)``)."""
    text = str(task.state.value)
    if task.skip_reason:
        text += f" ({task.skip_reason})"
    counts = task.map_counts
    if counts is not None:
        text += (
            f" {counts['done']:,}/{counts['total']:,} done: {counts['succeeded']:,} ok, {counts['failed']:,} failed,"
            f" {counts['skipped']:,} skipped"
        )
    if task.map_parent is not None:
        text += f" (item {task.map_index} of {task.map_parent})"
    return text


def format_task_table(tasks: list[Any]) -> str:
    """A plain-text table of tasks: key, state (with a skip reason, a map's counts, a child's
    item: :func:`state_text`), attempt, duration, error."""
    from ..core.states import TaskState

    header = ("KEY", "STATE", "ATTEMPT", "DURATION", "ERROR")
    rows = [
        (
            t.key,
            state_text(t),
            str(t.attempt),
            f"{t.duration:.2f}s" if t.duration is not None else "-",
            (t.error or "")[:60] if t.state is not TaskState.SUCCEEDED else "",
        )
        for t in tasks
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


class _Path(click.Path):
    """click's Path, refusing a path holding a NUL as a usage error (``os.stat`` raises
    ValueError for it, which click lets through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\x00" in value:
            self.fail("a path cannot hold a NUL character", param, ctx)
        return super().convert(value, param, ctx)


def _fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: MESSAGE`` as one line on stderr and exit ``code``."""
    click.echo("error: " + " ".join(str(message).split()), err=True)
    sys.exit(code)


class _Group(click.Group):
    """Every error as one ``error: …`` line on stderr, never a traceback: exit 2 for orchestrator
    errors, database errors, files that cannot be read or written and usage errors (click's
    own, made one line); an unexpected exception (a bug) is one line too, exit 2."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # a group alone: its help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail(exc.format_message() + hint, exc.exit_code)
        except click.ClickException as exc:  # a command's refusal: exit 2 as every error
            _fail(exc.format_message())
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        import sqlalchemy as sa

        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OrchestratorError as exc:
            _fail(str(exc))
        except sa.exc.DBAPIError as exc:
            # unreachable or misconfigured database: the driver's first line (never the URL's password)
            first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
            _fail(f"database: {first}")
        except sa.exc.ArgumentError as exc:
            _fail(f"database URL: {exc}")
        except OSError as exc:  # a file that cannot be read or written (a missing folder, a full disk)
            where = f": {exc.filename}" if exc.filename else ""
            _fail(f"{exc.strerror or exc}{where}")
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the last guard: a bug, still one line
            _fail(f"unexpected {type(exc).__name__} (a bug; please report it): {exc}")


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
    from ..runtime.celery_app import get_app

    get_app().worker_main(argv=["worker", *worker_argv(list(ctx.args))])


def worker_argv(args: list[str]) -> list[str]:
    """``celery worker`` options from ``orchestrator worker``'s: ``--tenant NAME`` (or
    ``--tenant=NAME``) becomes ``-Q`` with that tenant's dedicated queues."""
    from ..core.dag import TENANT_RE
    from ..core.errors import ValidationError
    from ..core.routing import tenant_queues

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
    """Start celery beat firing the database's schedules; options go to `celery beat`.

    It runs celery beat with -S orchestrator.runtime.beat:DatabaseScheduler (unless you give another -S):
    every pass fires the schedules that are due by the database clock, each under its row lock,
    so several beats may run side by side and each instant still fires once; then it finishes the
    event triggers' firings left open (`orchestrator on`). Schedules added, changed or paused with
    `orchestrator schedule` are seen within ORCHESTRATOR_BEAT_INTERVAL seconds. Beat is not needed
    for retries or recovery: the reconciler runs in the workers.
    """
    from ..runtime.celery_app import get_app

    args = list(ctx.args)
    if not any(a in ("-S", "--scheduler") or a.startswith("--scheduler=") for a in args):
        args = ["-S", "orchestrator.runtime.beat:DatabaseScheduler", *args]
    get_app().start(argv=["beat", *args])


@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command()
@click.argument("revision", default="head")
def upgrade(revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    from ..store import migrate

    engine = _engine()
    migrate.upgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
@click.argument("revision")
def downgrade(revision: str) -> None:
    """Migrate the database down to REVISION ("base" drops every table)."""
    from ..store import migrate

    engine = _engine()
    migrate.downgrade(engine, revision)
    click.echo(f"database at revision {migrate.current(engine)}")


@db.command()
def current() -> None:
    """Print the database's revision and the newest one."""
    from ..store import migrate

    click.echo(f"current: {migrate.current(_engine())}  head: {migrate.head()}")


@db.command()
def check() -> None:
    """Exit 1 unless the database is at head and matches the declared schema exactly."""
    from ..store import migrate

    engine = _engine()
    at, head = migrate.current(engine), migrate.head()
    diff = migrate.schema_diff(engine)
    if at != head or diff:
        click.echo(f"schema mismatch: revision {at} (head {head})", err=True)
        for item in diff:
            click.echo(f"  {item}", err=True)
        sys.exit(1)
    click.echo(f"schema matches orchestrator/store/schema.py at revision {head}")


def _age(text: str, option: str) -> Any:
    """An age (``30d``, ``12h``, ``90m``) as a timedelta, or None when ``text`` is not one."""
    import datetime as dt
    import re

    from ..core.errors import ValidationError

    found = re.fullmatch(r"(\d{1,6})([dhm])", text.strip())
    if not found:
        return None
    unit = {"d": "days", "h": "hours", "m": "minutes"}[found.group(2)]
    age = dt.timedelta(**{unit: int(found.group(1))})
    if age > dt.timedelta(days=365 * 1000):
        raise ValidationError(f"{option} {text}: an age of at most 1000 years (365000d)")
    return age


def _cut_off(text: str) -> Any:
    """``--before``: an ISO 8601 date or date-time (UTC without an offset), or an age: ``30d``,
    ``12h``, ``90m``. Anything else, or an instant out of range, is a ValidationError (one line,
    exit 2)."""
    import datetime as dt

    from ..core.errors import ValidationError

    age = _age(text, "--before")
    if age is not None:
        return dt.datetime.now(dt.UTC) - age
    try:
        moment = dt.datetime.fromisoformat(text.strip())
        return moment.astimezone(dt.UTC) if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    except (ValueError, OverflowError):
        raise ValidationError(
            f"--before {text!r}: give an ISO 8601 date or date-time (from year 1), or an age such as 30d, 12h"
        ) from None


@db.command("clean")
@click.option(
    "--before",
    "before",
    required=True,
    help="Remove runs created and finished before this: a date, a date-time or an age (30d, 12h).",
)
@click.option(
    "--archive",
    type=_Path(dir_okay=False),
    default=None,
    help="Append each batch to this file (JSON lines, one run with its tasks, edges and ledger each), flushed to the"
    " disk before the batch is deleted; a failed write removes nothing of its batch.",
)
@click.option("--batch", type=click.IntRange(1, 10_000), default=500, show_default=True, help="Runs per transaction.")
@click.option(
    "--pause",
    type=click.FloatRange(0, 60),
    default=0.0,
    show_default=True,
    help="Seconds left to the running work between two batches (a slower clean that takes less from the hot path).",
)
@click.option(
    "--keep-keys",
    default="90d",
    show_default=True,
    metavar="AGE",
    help="How long a removed run's idempotency key is kept (a submit with it is refused, naming the removed run);"
    " older kept keys are forgotten (0d: none kept).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print the totals as JSON.")
def db_clean(
    before: str, archive: str | None, batch: int, pause: float, keep_keys: str, dry_run: bool, as_json: bool
) -> None:
    """Prune the ledger: remove the final runs (SUCCEEDED, FAILED, CANCELLED) created and finished
    before --before, with their tasks, edges and ledger rows, in short batches (a RUNNING run is
    never touched; the hot path is not held up). The removed runs' idempotency keys are kept for
    --keep-keys. One tenant's only with `orchestrator --tenant T`."""
    from ..core.errors import ValidationError

    cut = _cut_off(before)
    keep = _age(keep_keys, "--keep-keys")
    if keep is None:
        raise ValidationError(f"--keep-keys {keep_keys!r}: give an age such as 90d, 12h or 0d")
    orc = _ready_store()
    cleanup = orc.store.cleanup
    if dry_run:
        found = cleanup.count(cut, tenant=orc.tenant)
    else:
        found = cleanup.clean(cut, batch=batch, tenant=orc.tenant, archive=archive, pause=pause, keep_keys=keep)
    if as_json:
        _dump({"before": cut.isoformat(), "dry_run": dry_run, **found.to_json()})
        return
    what = "would remove" if dry_run else "removed"
    states = ", ".join(f"{n} {st.lower()}" for st, n in sorted(found.by_state.items())) or "none"
    click.echo(
        f"{what} {found.runs:,} run(s) ({states}) created before {cut.isoformat(timespec='seconds')}:"
        f" {found.tasks:,} task(s), {found.edges:,} edge(s), {found.events:,} ledger row(s)"
        + ("" if dry_run else f" in {found.batches} batch(es)")
        + (f"; archived to {archive}" if archive and not dry_run else "")
        + (f"; {found.keys_kept:,} idempotency key(s) {'to keep' if dry_run else 'kept'}" if found.keys_kept else "")
        + (f", {found.keys_forgotten:,} older one(s) forgotten" if found.keys_forgotten else "")
    )


@main.group()
def embedded() -> None:
    """The embedded default's PostgreSQL (ORCHESTRATOR_DATABASE_URL unset): the first process
    that needs it starts it, the others attach, and it stays up until `embedded stop`."""


def _embedded_dir() -> Any:
    from ..core.config import Settings
    from ..store import embedded as emb

    settings = Settings.from_env()
    if not settings.embedded:
        raise OrchestratorError(
            "ORCHESTRATOR_DATABASE_URL names a database server: the embedded PostgreSQL is not in use"
        )
    return emb.data_dir_of(settings.database_url)


@embedded.command("start")
def embedded_start() -> None:
    """Start the embedded PostgreSQL (initialising its data directory the first time)."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    emb.ensure(pgdata)
    st = emb.status(pgdata)
    click.echo(f"embedded PostgreSQL running (pid {st.pid}) in {pgdata}")


@embedded.command("status")
def embedded_status() -> None:
    """Say whether the embedded PostgreSQL runs; exit 3 when it does not."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    st = emb.status(pgdata)
    if not st.running:
        click.echo(f"embedded PostgreSQL not running ({pgdata})")
        sys.exit(3)
    click.echo(f"embedded PostgreSQL running (pid {st.pid}) in {pgdata}, socket in {st.socket_dir}")


@embedded.command("stop")
def embedded_stop() -> None:
    """Stop the embedded PostgreSQL (stop the workers, beat and serve that use it first)."""
    from ..store import embedded as emb

    pgdata = _embedded_dir()
    if emb.stop(pgdata):
        click.echo(f"embedded PostgreSQL stopped ({pgdata})")
    else:
        click.echo(f"embedded PostgreSQL was not running ({pgdata})")


def _ready_store() -> Orchestrator:
    return _orc().ready()  # migrates the embedded default, checks any other schema


def _param(values: tuple[str, ...]) -> dict[str, Any] | None:
    """``--param KEY=VALUE`` options as params: each VALUE read as JSON, else as text."""
    if not values:
        return None
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise click.UsageError(f"--param takes KEY=VALUE, not {item[:60]!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
        except RecursionError:
            raise click.UsageError(f"--param {key.strip()[:60]}: the value is nested too deep") from None
    return out


@main.command()
@click.argument("file", type=_Path(dir_okay=False), required=False)
@click.option("--dag", "registered", metavar="NAME[@N]", help="Run the registered DAG NAME (its latest version, or N).")
@click.option(
    "--param", "params", multiple=True, metavar="KEY=VALUE",
    help="With --dag: a param laid over the DAG's own (VALUE read as JSON, else as text); repeatable.",
)  # fmt: skip
@click.option("--tenant", help="Run for this tenant instead of the spec's.")
@click.option("--idempotency-key", help="Submitting the same key again returns the same run.")
@click.option(
    "--wait",
    "wait_",
    is_flag=True,
    help="Follow the run (a live view on a terminal, one line per change when piped); exit 0 only if it SUCCEEDED.",
)
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
def submit(
    file: str | None,
    registered: str | None,
    params: tuple[str, ...],
    tenant: str | None,
    idempotency_key: str | None,
    wait_: bool,
    timeout: float | None,
) -> None:
    """Submit the DAG spec FILE (YAML or JSON), or the registered DAG named with --dag NAME[@N]
    (`orchestrator dag register`); prints the run id first, and each warning about the DAG (a
    join below a branch that keeps all_success, a paused DAG run by hand, ...) on stderr as
    `warning: ...`."""
    from ..core.dag import load_spec
    from ..services.dag_registry import parse_ref
    from .demo import follow

    if (file is None) == (registered is None):
        raise click.UsageError("give a spec FILE or --dag NAME[@N] (one of them)")
    if params and registered is None:
        raise click.UsageError("--param goes with --dag (a spec file holds its params)")
    if registered is not None:
        name, version = parse_ref(registered)
        orc = _ready_store()
        run = orc.submit_registered(
            name, version, params=_param(params), idempotency_key=idempotency_key, tenant=tenant
        )
    else:
        assert file is not None
        dag = load_spec(file)
        orc = _ready_store()
        run = orc.submit(dag, tenant=tenant, idempotency_key=idempotency_key)
    click.echo(run.id)
    for warning in run.warnings:
        click.echo(f"warning: {warning}", err=True)
    if not wait_:
        return
    if sys.stderr.isatty():
        from rich.console import Console

        from .watch import watch as live

        state = live(orc, run.id, timeout=timeout, console=Console(stderr=True))
    else:
        state = follow(run, lambda line: click.echo(line, err=True), timeout or float("inf"))
        click.echo(format_task_table(run.tasks()), err=True)
    click.echo(state.value)
    sys.exit(0 if state.value == "SUCCEEDED" else 1)


@main.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {run, tasks}.")
def status(run_id: str, as_json: bool) -> None:
    """Show a run and its tasks (a SKIPPED task with its reason, a mapped node with its
    children counted, a map's child with its item)."""
    orc = _ready_store()
    view = orc.visible(run_id)
    tasks = orc.tasks(run_id)
    if as_json:
        _dump({"run": view.to_json(), "tasks": [t.to_json() for t in tasks]})
        return
    attention = "  (needs attention)" if view.needs_attention else ""
    fired = f"  schedule {view.schedule}" if view.schedule else ""
    logical = f"  logical date {view.logical_date}" if view.logical_date else ""
    version = f"  version {view.dag_version}" if view.dag_version is not None else ""
    again = f"  rerun of {view.rerun_of}" if view.rerun_of else ""
    again += f"  trigger {view.trigger}" if view.trigger else ""
    click.echo(
        f"run {view.id}  dag {view.dag}{version}  tenant {view.tenant}  state {view.state.value}{attention}{fired}"
        f"{logical}{again}"
    )
    click.echo(format_task_table(tasks))


@main.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"runs": [...]}.')
@click.option("--limit", default=20, show_default=True)
@click.option("--offset", default=0, show_default=True, help="Skip this many newer runs (paging).")
@click.option("--tenant", default=None, help="Only this tenant's runs.")
@click.option("--dag", default=None, help="Only runs of this DAG.")
@click.option("--version", "version", type=int, default=None, help="With --dag: only runs of this registered version.")
@click.option("--state", default=None, help="Only runs in this state (RUNNING, SUCCEEDED, FAILED, CANCELLED).")
def runs(
    as_json: bool, limit: int, offset: int, tenant: str | None, dag: str | None, version: int | None,
    state: str | None,
) -> None:  # fmt: skip
    """List recent runs, newest first (a run of a registered DAG with its version, `etl@3`)."""
    if version is not None and dag is None:
        raise click.UsageError("--version goes with --dag NAME")
    views = _ready_store().runs(limit, tenant=tenant, dag=dag, state=state, offset=offset, dag_version=version)
    if as_json:
        _dump({"runs": [v.to_json() for v in views]})
        return
    for v in views:
        created = v.created_at.isoformat(timespec="seconds") if v.created_at else "-"
        attention = "  (needs attention)" if v.needs_attention else ""
        name = v.dag if v.dag_version is None else f"{v.dag}@{v.dag_version}"
        click.echo(f"{v.id}  {v.state.value:<9}  {name}  tenant={v.tenant}  tasks={v.task_count}  {created}{attention}")


@main.command()
@click.argument("run_id")
@click.option("--poll", type=float, default=0.5, show_default=True, help="Seconds between redraws.")
@click.option("--timeout", type=float, default=None, help="Stop watching after this many seconds (the run goes on).")
def watch(run_id: str, poll: float, timeout: float | None) -> None:
    """Watch a run live until it is final: progress bar, counts per state, the running tasks
    and the newest ledger events. Exits 0 if the run SUCCEEDED, 1 otherwise."""
    from .watch import watch as live

    state = live(_ready_store(), run_id, poll=poll, timeout=timeout)
    sys.exit(0 if state.value == "SUCCEEDED" else 1)


@main.command()
@click.argument("run_id")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["svg", "dot", "mermaid"]),
    default="svg",
    show_default=True,
    help="SVG (as on the run page), Graphviz dot, or a Mermaid flowchart.",
)
@click.option("-o", "--output", type=_Path(dir_okay=False, writable=True), help="Write to FILE (default: stdout).")
def graph(run_id: str, fmt: str, output: str | None) -> None:
    """Draw a run's DAG, tasks coloured by state, as the run page of `orchestrator serve` does."""
    from ..core import graph as drawing
    from ..web.app import run_graph

    text = drawing.FORMATS[fmt](run_graph(_ready_store(), run_id))
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--behind-tls-proxy", is_flag=True, default=None,
    help="A proxy in front terminates TLS: cookies are Secure (default: ORCHESTRATOR_UI_BEHIND_TLS_PROXY).",
)  # fmt: skip
def serve(host: str, port: int, behind_tls_proxy: bool | None) -> None:
    """Serve the web UI, its JSON API and Prometheus /metrics, from the database.

    Runs at /runs (filters: tenant, DAG, state), a run with its DAG drawn at /runs/RUN_ID, its
    JSON at /api/runs/RUN_ID, metrics at /metrics. Every page, JSON document, action and
    /metrics needs a credential of ORCHESTRATOR_UI_AUTH (user:password for basic auth, or a
    token; =TENANT binds one to a tenant). Unset, a loopback bind makes a token at start and
    prints its login URL; any other bind refuses to start (exit 2), as it refuses a basic-auth
    password shorter than 12 characters. Wrong credentials are rate-limited (429)."""
    from ..web.app import Access
    from ..web.app import serve as run_server

    orc = _orc()
    Access(orc.settings.ui_auth, host)  # refuse a bad or missing credential before opening the database
    orc.ready()
    try:
        run_server(
            orc, host=host, port=port, auth=orc.settings.ui_auth, ready=lambda line: click.echo(line, err=True),
            behind_tls_proxy=behind_tls_proxy or None,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass


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

    from ..services.reconciler import ReconcilerService

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
    rows = orc.events(run_id)
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
    found = _ready_store().set_breaker(
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
    orc = _ready_store()
    found = orc.breaker(name)
    events = orc.breaker_events(name, limit=20)
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
    found = _ready_store().breakers()
    if as_json:
        _dump({"breakers": [b.to_dict() for b in found]})
        return
    for b in found:
        click.echo(_breaker_text(b))


def _breaker_action(action: str, name: str, reason: str | None) -> None:
    orc = _ready_store()
    act = {"open": orc.open_breaker, "close": orc.close_breaker, "disable": orc.disable_breaker}[action]
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

    if not _ready_store().remove_breaker(name, by=_by()):
        raise UnknownBreakerError(f"no breaker named {name!r} (orchestrator breaker set {name})")
    click.echo(f"breaker {name} removed")


@main.group()
def dag() -> None:
    """The DAG registry (register, versions, show, diff, pause) and limits of a DAG across its
    runs; one tenant's: orchestrator --tenant T dag ... (else tenant `default`)."""


def _dags() -> Any:
    return _ready_store().dags


@dag.command("register")
@click.argument("spec_file", type=_Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the version as JSON (with created: true|false).")
def dag_register(spec_file: str, as_json: bool) -> None:
    """Register the DAG spec SPEC_FILE under its name: a new version only when its content
    differs from the latest (registering the same content again returns the same version, exit
    0). Validated as a submit is; nothing is stored when it would not submit. Prints `NAME vN`."""
    from ..core.dag import load_spec

    dag_obj = load_spec(spec_file)
    found = _ready_store().register(dag_obj, by=_by())
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
    orc = _ready_store()
    orc.set_dag_limit(name, None if no_max_running else max_running)
    tenant_now = orc.tenant or "default"
    limit_now = orc.dag_limits().get((tenant_now, name))
    click.echo(f"DAG {name} (tenant {tenant_now}): max running {limit_now or 'unlimited'}")


@dag.command("list")
@click.option("--json", "as_json", is_flag=True, help='Print {"dags": [...]}.')
def dag_list(as_json: bool) -> None:
    """Registered DAGs (latest version, paused) and DAGs with a limit across their runs."""
    orc = _ready_store()
    registered = {(d.tenant, d.name): d for d in orc.dags.list()}
    limits = orc.dag_limits()
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
    run cancelled; why a task was skipped (with the ledger's reason), a map's children counted,
    a map child's map and item, and an early verdict that decided a task."""
    from ..core.states import TaskState

    found = _ready_store().explain(run_id, key)
    if key is None and not show_all:
        found = [e for e in found if not e.state.terminal and e.state is not TaskState.RUNNING]
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
    orc = _ready_store()
    ids = list(run_ids) if run_ids else [v.id for v in orc.runs(limit)]
    problems = orc.verify(ids, allow_dead_letter=True, in_progress_ok=True)
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

    The ledger records who acted and from where (`user@host (cli)`). Exits 2 with an `error:` line when the run
    is unknown or already final."""
    revoked = _ready_store().cancel(run_id, by=_by())
    click.echo(f"run {run_id} cancelled; {revoked} running or queued task(s) revoked")


@main.command()
@click.argument("run_id")
@click.argument("key")
def retry(run_id: str, key: str) -> None:
    """Retry a DEAD_LETTER or FAILED task (attempt + 1).

    Exits 2 with an `error:` line when the task's state does not allow it or another writer
    changed it first (the refused write is in the ledger)."""
    _ready_store().retry_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} is READY again")


@main.command()
@click.argument("run_id")
@click.argument("key")
def skip(run_id: str, key: str) -> None:
    """Skip a DEAD_LETTER task; its descendants follow their trigger rules (errors as `retry`)."""
    _ready_store().skip_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} SKIPPED")


@main.command()
@click.argument("run_id")
@click.argument("keys", nargs=-1, required=True)
@click.option("--downstream", is_flag=True, help="Also every task below them.")
@click.option("--upstream", is_flag=True, help="Also every task above them.")
@click.option("--only-failed", is_flag=True, help="Only those FAILED or UPSTREAM_FAILED.")
@click.option("--dry-run", is_flag=True, help="List what would be cleared; write nothing.")
def clear(
    run_id: str, keys: tuple[str, ...], downstream: bool, upstream: bool, only_failed: bool, dry_run: bool
) -> None:
    """Run tasks again: KEYs (and with the flags their descendants / ancestors) go back with
    attempt + 1, each with a ledger row naming who asked; a running attempt among them is fenced
    (its late result refused and recorded) and revoked; a finished run reopens. Exits 2 with an
    `error:` line for an unknown task, a CANCELLED run or nothing to clear. A map is cleared with its
    children; cleared with the task it maps over, it is expanded again (old children removed)."""
    cleared = _ready_store().clear(
        run_id, *keys, downstream=downstream, upstream=upstream, only_failed=only_failed, dry_run=dry_run, by=_by()
    )
    verb = "would clear" if dry_run else "cleared"
    click.echo(f"{run_id}: {verb} {len(cleared)} task(s): {', '.join(cleared)}")


@main.command()
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
    held = _ready_store().mark(run_id, key, state, by=_by())
    click.echo(f"{run_id}.{key}: {held.value} -> {state}")


@main.command()
@click.argument("run_id")
def rerun(run_id: str) -> None:
    """A new run of RUN_ID's DAG snapshot and params, for its tenant, linked to it (`rerun_of`);
    prints the new run's id."""
    handle = _ready_store().rerun(run_id)
    click.echo(handle.id)


@main.command(name="fail")
@click.argument("run_id")
@click.argument("key")
def fail_task(run_id: str, key: str) -> None:
    """Give up on a DEAD_LETTER task: it becomes FAILED and its descendants follow (errors as `retry`)."""
    _ready_store().fail_task(run_id, key, by=_by())
    click.echo(f"{run_id}.{key} FAILED")


def _schedules() -> Schedules:
    return _ready_store().schedules


def _when(value: str | None) -> str:
    return value or "-"


@main.group()
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


# ---------------------------------------------------------------------- events, signals, approvals


def _json_text(text: str, option: str) -> Any:
    """An option's JSON value, or ValidationError: not JSON, NaN / Infinity, a duplicate key, or
    nested too deep to read (never a RecursionError; what is read is then held to the JSON depth
    limit of what it is for)."""
    from ..core.dag import parse_spec
    from ..core.errors import SpecError, ValidationError

    try:
        return parse_spec(text, fmt="json")
    except SpecError as exc:
        raise ValidationError(f"{option} is not JSON: {str(exc).removeprefix('cannot parse JSON: ')}") from None


def _json_object(text: str | None, option: str) -> dict[str, Any] | None:
    """An option's JSON object (``--payload``, ``--match``, ``--params``), or ValidationError."""
    from ..core.errors import ValidationError

    if text is None:
        return None
    value = _json_text(text, option)
    if not isinstance(value, dict):
        raise ValidationError(f"{option} must be a JSON object, not {type(value).__name__}")
    return value


def _emitted_line(done: Any) -> str:
    if done.duplicate:
        return f"event {done.event_id}: duplicate, ignored"
    return f"event {done.event_id}: woke {done.woken} task(s)"


@main.command()
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
    done = _ready_store().emit(key, _json_object(payload, "--payload"), event_id=event_id, by=_by())
    if as_json:
        click.echo(
            json.dumps({"id": done.id, "event_id": done.event_id, "duplicate": done.duplicate, "woken": done.woken})
        )
    else:
        click.echo(_emitted_line(done))


@main.command()
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
    done = _ready_store().signal(run_id, name, _json_object(payload, "--payload"), event_id=event_id, by=_by())
    click.echo(_emitted_line(done).replace("event", "signal", 1))


@main.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--comment", default=None, help="Why (kept with the answer).")
def approve(run_id: str, key: str, comment: str | None) -> None:
    """Approve the approval node KEY of run RUN_ID (it must be WAITING for an approval): it
    succeeds, recorded with who approved."""
    _ready_store().approve(run_id, key, by=_by(), comment=comment)
    click.echo(f"{run_id}.{key} approved")


@main.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--comment", default=None, help="Why (kept with the answer).")
def reject(run_id: str, key: str, comment: str | None) -> None:
    """Reject the approval node KEY of run RUN_ID: it fails (Rejected), its downstream follows
    its trigger rules."""
    _ready_store().reject(run_id, key, by=_by(), comment=comment)
    click.echo(f"{run_id}.{key} rejected")


# ---------------------------------------------------------------------- event triggers


def _triggers() -> Triggers:
    return _ready_store().triggers


@main.group()
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
    "--paused/--no-paused",
    default=None,
    help="Add it paused (--no-paused: active); by default a new trigger is active and a replaced one keeps its flag.",
)
def on_add(
    name: str, event: str, match: str | None, spec_file: str | None, factory: str | None, registered: str | None,
    params: str | None, max_active_runs: int | None, paused: bool | None,
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
    )  # fmt: skip
    state = "paused" if found.paused else "active"
    click.echo(f"trigger {name}: on {found.event}, {found.what}; {state}")


@on.command("apply")
@click.argument("file", type=_Path(dir_okay=False))
def on_apply(file: str) -> None:
    """Upsert every trigger of FILE (YAML/JSON: {"triggers": [{name, event, match,
    spec|dag|registered, params, max_active_runs, paused}]}; a spec path is relative to FILE).
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


@main.command()
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
        states = [_ready_store().run(r).wait(None).state.value for r in runs]
        summary["succeeded"] = states.count("SUCCEEDED")
    if lines:
        click.echo(json.dumps({"summary": summary}))
    else:
        click.echo(", ".join(f"{k} {v}" for k, v in summary.items()))
    if failed or (wait_ and summary["succeeded"] != len(runs)):
        sys.exit(1)


@main.command()
@click.option(
    "--runs", default=100, show_default=True, help="At least this many DAG runs (more while faults are owed)."
)
@click.option("--seed", default=1, show_default=True, help="Random seed of the DAGs and of the fault sequence.")
@click.option("--workers", default=2, show_default=True, help="Prefork worker processes (-c 2 each).")
@click.option("--min-faults", default=200, show_default=True, help="Keep injecting until this many faults.")
@click.option("--database-url", envvar="ORCHESTRATOR_CHAOS_DATABASE_URL", default=None,
              help="Use this Postgres database (wiped first) instead of a private server of the soak's own;"
                   " the server is then never restarted.")  # fmt: skip
@click.option("--timeout", default=900.0, show_default=True, help="Give up after this many seconds.")
@click.option("--claim-delay", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="The workers' ORCHESTRATOR_CLAIM_DELAY (direct messages' bodies before their claim).")  # fmt: skip
@click.option("--mix", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also this many operator actions, maps, waits and events at random moments (the interaction"
                   " soak; see docs/operations.md).")  # fmt: skip
def chaos(
    runs: int,
    seed: int,
    workers: int,
    min_faults: int,
    database_url: str | None,
    timeout: float,
    claim_delay: float,
    mix: int,
) -> None:
    """Soak a local deployment (private Postgres and Redis, real workers, reconciler) under
    eleven kinds of random fault, and report them per kind.

    Exits 1 if any invariant broke: a task lost, stuck or committed twice, an illegal
    transition, a child started before its parent. The database is wiped first.
    """
    from ..testing.chaos import run_chaos

    sys.exit(run_chaos(runs=runs, seed=seed, database_url=database_url, workers=workers,
                       min_faults=min_faults, timeout=timeout, claim_delay=claim_delay, mix=mix))  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    main()
