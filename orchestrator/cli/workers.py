"""The long-running processes beside the database: ``worker``, ``beat`` and ``reconcile``; and
``workers``, the live workers listed."""

from __future__ import annotations

from typing import Any

import click

from . import base


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def worker(ctx: click.Context) -> None:
    """Start a Celery worker of the project's app; options go to `celery worker`.

    Without -Q it consumes every queue the orchestrator routes to by default. `--tenant NAME`
    (this command's own option) consumes only that tenant's dedicated queues
    (orchestrator.tenant.NAME.high/default/low: see `orchestrator tenant set NAME --dedicated`).
    It advertises a code version (ORCHESTRATOR_CODE_VERSION, else a hash of its task modules) and
    also consumes QUEUE@VERSION for each queue, where the runs submitted with that
    --code-version go. Beside its pool the worker's main process keeps its capacity registered and runs the
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


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
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


@click.command()
@click.option("--once", is_flag=True, help="Run one pass and exit (default: loop every ORCHESTRATOR_TICK_SECONDS).")
@click.option("--interval", type=float, default=None, help="Seconds between passes (default: tick_seconds).")
@click.option("--name", default=None, help="Name shown for this reconciler (default: reconcile@HOST:PID).")
def reconcile(once: bool, interval: float | None, name: str | None) -> None:
    """Run the reconciler as a service: release due retries, re-publish lost dispatches,
    expire leases, dispatch free capacity and close finished runs.

    Every worker already runs one; this command is for deployments that want it apart from
    the workers. Only one reconciler is on duty at a time across the deployment (a Postgres
    advisory lock); the others wait and print nothing. Prints one line of counts per pass.

    With ORCHESTRATOR_RECONCILER_SHARDS=K (the sharded mode) every instance reconciles at once,
    each the runs of the shards it claimed (ceil(K / live instances)), every write fenced by the
    shard's epoch; `--once` then takes this instance's share for one pass and gives it back.
    `orchestrator shards` shows who holds what.
    """
    import os
    import signal
    import socket

    from ..services.reconciler import ReconcilerService

    orc = base._ready_store()
    service = ReconcilerService(
        orc.reconciler,
        name=name or f"reconcile@{socket.gethostname()}:{os.getpid()}",
        interval=interval or orc.settings.tick_seconds,
        stall_seconds=orc.settings.reconciler_stall_seconds,
    )
    if once and service.shards is None:
        click.echo(" ".join(f"{k}={v}" for k, v in orc.reconcile().items()))
        return
    # SIGTERM ends the loop after its pass, so that the service gives its duty or shards back
    signal.signal(signal.SIGTERM, lambda signum, frame: service.stop())
    service.run(once=once, echo=lambda report: click.echo(" ".join(f"{k}={v}" for k, v in report.items())))


@click.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"workers": [...]}, with each worker\'s task names.')
def workers(as_json: bool) -> None:
    """List the live workers: name, code version, pool size, task names registered, when last
    seen, queues.

    A worker is live while its registry heartbeat is younger than ORCHESTRATOR_WORKER_TTL. Its
    queues include QUEUE@VERSION for each queue it consumes (runs pinned to its version); TASKS
    is how many task names it registered (`*`: a worker that does not say, which takes every
    name). `orchestrator explain` says which worker, version or task a held task waits for.
    """
    orc = base._ready_store()
    found = orc.list_workers()
    if as_json:
        base._dump({"workers": [w.to_json() for w in found]})
        return
    if not found:
        click.echo("no live worker (start one: orchestrator worker)")
        return
    click.echo(format_workers(found))


def format_workers(found: list[Any]) -> str:
    """A plain-text table of workers (:class:`~orchestrator.store.reads.WorkerView`)."""
    header = ("NAME", "VERSION", "CONCURRENCY", "TASKS", "LAST SEEN", "QUEUES")
    rows = [
        (
            w.name,
            w.code_version or "-",
            str(w.concurrency),
            "*" if w.task_count is None else str(w.task_count),
            f"{w.seen_ago:.1f}s ago",
            ",".join(w.queues),
        )
        for w in found
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])
