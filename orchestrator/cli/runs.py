"""Submitting and inspecting runs: ``submit``, ``status``, ``runs``, ``watch``, ``graph``, ``events``,
``explain`` and ``verify``."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import click

from ..core.tags import tags_text
from . import base
from .base import _batch_option, _dump, _Path, format_task_table


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


@click.command()
@click.argument("file", type=_Path(dir_okay=False), required=False)
@click.option("--dag", "registered", metavar="NAME[@N]", help="Run the registered DAG NAME (its latest version, or N).")
@click.option(
    "--param", "params", multiple=True, metavar="KEY=VALUE",
    help="With --dag: a param laid over the DAG's own (VALUE read as JSON, else as text); repeatable.",
)  # fmt: skip
@click.option("--tenant", help="Run for this tenant instead of the spec's.")
@click.option("--idempotency-key", help="Submitting the same key again returns the same run.")
@click.option(
    "--tag", "tag_items", multiple=True, metavar="KEY=VALUE",
    help="A tag of the run (repeatable; `runs --tag` and `bulk --tag` select by them).",
)  # fmt: skip
@click.option(
    "--code-version",
    metavar="VERSION",
    help="Pin the run to workers advertising this code version (their QUEUE@VERSION queues; see `orchestrator"
    " workers`): its tasks wait until such a worker that has them is live.",
)
@click.option("--concurrency-key", metavar="KEY", help="Keyed flow control: the run's key (per tenant).")
@click.option("--max-concurrent", type=int, help="With --concurrency-key: most runs of the key at once.")
@click.option(
    "--on-busy", type=click.Choice(["queue", "skip", "cancel_running", "replace_queued"]),
    help="With --concurrency-key: what a submit to a busy key does (default queue).",
)  # fmt: skip
@click.option("--throttle", metavar="N/PERIOD", help="With --concurrency-key: most runs per period (10/minute).")
@click.option("--debounce", metavar="DURATION", help="With --concurrency-key: run once the key is quiet (30s).")
@click.option("--max-wait", metavar="DURATION", help="With --debounce: the longest a burst waits (5m).")
@click.option(
    "--batch", metavar="N,WINDOW",
    help="With --concurrency-key: gather submits, up to N or WINDOW (5s) from the first, into one run"
    " (its 'events' param lists them).",
)  # fmt: skip
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
    tag_items: tuple[str, ...],
    code_version: str | None,
    wait_: bool,
    timeout: float | None,
    **flow: Any,
) -> None:
    """Submit the DAG spec FILE (YAML or JSON), or the registered DAG named with --dag NAME[@N]
    (`orchestrator dag register`); prints the run id first, and each warning about the DAG (a
    join below a branch that keeps all_success, a paused DAG run by hand, ...) on stderr as
    `warning: ...`."""
    from ..core.dag import load_spec
    from ..core.tags import parse_tag_filters
    from ..services.dag_registry import parse_ref
    from .demo import follow

    tags = parse_tag_filters(tag_items) or None
    flow = {k: v for k, v in flow.items() if v is not None}  # keyed flow control (core/flow.py checks it)
    if "batch" in flow:
        flow["batch"] = _batch_option(flow["batch"])

    if (file is None) == (registered is None):
        raise click.UsageError("give a spec FILE or --dag NAME[@N] (one of them)")
    if params and registered is None:
        raise click.UsageError("--param goes with --dag (a spec file holds its params)")
    if registered is not None:
        name, version = parse_ref(registered)
        orc = base._ready_store()
        if code_version is None and tags is None and not flow:
            run = orc.submit_registered(
                name, version, params=_param(params), idempotency_key=idempotency_key, tenant=tenant
            )
        else:  # what submit_registered does, pinned or tagged
            built, found = orc.dags.build(name, version, params=_param(params), tenant=tenant)
            run = orc.submit(
                built, idempotency_key=idempotency_key, dag_version=found.version, code_version=code_version,
                tags=tags, **flow,
            )  # fmt: skip
    else:
        assert file is not None
        dag = load_spec(file)
        orc = base._ready_store()
        run = orc.submit(
            dag, tenant=tenant, idempotency_key=idempotency_key, code_version=code_version, tags=tags, **flow
        )
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


@click.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {run, tasks}.")
def status(run_id: str, as_json: bool) -> None:
    """Show a run and its tasks (a SKIPPED task with its reason, a mapped node with its
    children counted, a map's child with its item)."""
    orc = base._ready_store()
    view = orc.visible(run_id)
    tasks = orc.tasks(run_id)
    progress = orc.progress(run_id)
    lineage = orc.children.lineage(run_id)  # a child run's parent, a parent's child runs
    if as_json:
        docs = [t.to_json() | {"progress": p.to_json() if (p := progress.get(t.key)) else None} for t in tasks]
        _dump({"run": view.to_json(), "tasks": docs, "lineage": lineage})
        return
    attention = "  (needs attention)" if view.needs_attention else ""
    fired = f"  schedule {view.schedule}" if view.schedule else ""
    logical = f"  logical date {view.logical_date}" if view.logical_date else ""
    version = f"  version {view.dag_version}" if view.dag_version is not None else ""
    again = f"  rerun of {view.rerun_of}" if view.rerun_of else ""
    again += f"  trigger {view.trigger}" if view.trigger else ""
    again += f"  tags {tags_text(view.tags)}" if view.tags else ""
    click.echo(
        f"run {view.id}  dag {view.dag}{version}  tenant {view.tenant}  state {view.state.value}{attention}{fired}"
        f"{logical}{again}"
    )
    if lineage["parent"]:
        up = lineage["parent"]
        click.echo(f"parent run {up['run_id']}  task {up['key']} (attempt {up['attempt']})")
    for kid in lineage["children"]:
        click.echo(f"child run {kid['run_id']}  of task {kid['key']} (attempt {kid['attempt']})  {kid['state']}")
    click.echo(format_task_table(tasks))
    for key, p in sorted(progress.items()):  # what each body last reported (update_state)
        click.echo(f"progress  {key}  {p.state}  {json.dumps(p.meta, separators=(',', ':'))[:200]}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"runs": [...]}.')
@click.option("--limit", default=20, show_default=True)
@click.option("--offset", default=0, show_default=True, help="Skip this many newer runs (paging).")
@click.option("--tenant", default=None, help="Only this tenant's runs.")
@click.option("--dag", default=None, help="Only runs of this DAG.")
@click.option("--version", "version", type=int, default=None, help="With --dag: only runs of this registered version.")
@click.option("--state", default=None, help="Only runs in this state (RUNNING, SUCCEEDED, FAILED, CANCELLED).")
@click.option(
    "--tag", "tag_items", multiple=True, metavar="KEY=VALUE", help="Only runs holding this tag (repeatable: every one)."
)
def runs(
    as_json: bool, limit: int, offset: int, tenant: str | None, dag: str | None, version: int | None,
    state: str | None, tag_items: tuple[str, ...],
) -> None:  # fmt: skip
    """List recent runs, newest first (a run of a registered DAG with its version, `etl@3`; a
    tagged run with its tags)."""
    from ..core.tags import parse_tag_filters

    if version is not None and dag is None:
        raise click.UsageError("--version goes with --dag NAME")
    tags = parse_tag_filters(tag_items)
    views = base._ready_store().runs(
        limit, tenant=tenant, dag=dag, state=state, offset=offset, dag_version=version, tags=tags
    )
    if as_json:
        _dump({"runs": [v.to_json() for v in views]})
        return
    for v in views:
        created = v.created_at.isoformat(timespec="seconds") if v.created_at else "-"
        attention = "  (needs attention)" if v.needs_attention else ""
        name = v.dag if v.dag_version is None else f"{v.dag}@{v.dag_version}"
        tagged = f"  {tags_text(v.tags)}" if v.tags else ""
        tagged += f"  key={v.flow_key}" if v.flow_key else ""
        tagged += f" (held: {v.held})" if v.held and v.state.value == "RUNNING" else ""
        click.echo(
            f"{v.id}  {v.state.value:<9}  {name}  tenant={v.tenant}  tasks={v.task_count}  {created}{attention}{tagged}"
        )


@click.command()
@click.argument("run_id")
@click.option("--poll", type=float, default=0.5, show_default=True, help="Seconds between redraws.")
@click.option("--timeout", type=float, default=None, help="Stop watching after this many seconds (the run goes on).")
def watch(run_id: str, poll: float, timeout: float | None) -> None:
    """Watch a run live until it is final: progress bar, counts per state, the running tasks
    and the newest ledger events. Exits 0 if the run SUCCEEDED, 1 otherwise."""
    from .watch import watch as live

    state = live(base._ready_store(), run_id, poll=poll, timeout=timeout)
    sys.exit(0 if state.value == "SUCCEEDED" else 1)


@click.command()
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
@click.option("--expand", is_flag=True, help="Draw every task group task by task (each is one box by default).")
@click.option(
    "--open", "opened", multiple=True, metavar="GROUP", help="Draw this task group task by task (repeatable)."
)
def graph(run_id: str, fmt: str, output: str | None, expand: bool, opened: tuple[str, ...]) -> None:
    """Draw a run's DAG, tasks coloured by state, as the run page of `orchestrator serve` does:
    each task group (DAG.group) one box counting its tasks, unless --expand or --open GROUP;
    edge labels (DAG.label) on their arrows."""
    from ..core import graph as drawing
    from ..web.app import run_graph

    groups = None if expand else tuple(sorted(set(opened)))
    text = drawing.FORMATS[fmt](run_graph(base._ready_store(), run_id, groups))
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


@click.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help='Print {"events": [...]}.')
def events(run_id: str, as_json: bool) -> None:
    """Show the ledger of a run: every transition, accepted or rejected."""
    orc = base._ready_store()
    rows = orc.ledger(run_id)
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


@click.command()
@click.argument("run_id")
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help='Print {"tasks": [{"key", "state", "reasons": [...]}]}.')
@click.option("--all", "show_all", is_flag=True, help="Also list running and finished tasks.")
@click.option("--expand", is_flag=True, help="List the tasks of each task group one by one (folded by default).")
def explain(run_id: str, key: str | None, as_json: bool, show_all: bool, expand: bool) -> None:
    """Why isn't it running? For every task of the run that is not running or finished (or
    only KEY), the reasons: parents it waits on, its trigger rule so far, a parent parked in
    DEAD_LETTER, a limit used up (the tenant's, the run's max_active_tasks, the DAG's: held by
    which runs), its pool full (held by which tasks) or missing, its rate limit out of tokens
    (the next at T) or missing, other tenants further below their fair share going first,
    READY behind N tasks of higher or equal priority, every worker
    slot in use, no live worker for its queue, waiting in the broker, a retry's backoff, the
    run cancelled; why a task was skipped (with the ledger's reason), a map's children counted,
    a map child's map and item, an early verdict that decided a task, and the setups of its
    setup scope it waits for. The tasks of a task group (``DAG.group``) are folded into one
    entry per group, their states and reasons counted; --expand lists them one by one."""
    from ..core.dag.groups import groups_of
    from ..core.states import TaskState

    found = base._ready_store().explain(run_id, key)
    if key is None and not show_all:
        found = [e for e in found if not e.state.terminal and e.state is not TaskState.RUNNING]
    if as_json:
        _dump({"run": run_id, "tasks": [e.to_json() for e in found]})
        return
    if not found:
        click.echo("every task is running or finished")
    folded: dict[str, list[Any]] = {}
    for e in found:
        group = groups_of(e.key)[:1]
        if group and key is None and not expand:
            folded.setdefault(group[0], []).append(e)
            continue
        click.echo(f"{e.key}  {e.state.value}")
        for r in e.reasons:
            click.echo(f"  - {r.kind}: {r.detail}")
    for name, members in folded.items():
        states = Counter(e.state.value for e in members)
        click.echo(f"{name}.*  group of {len(members)}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
        for kind, n in sorted(Counter(r.kind for e in members for r in e.reasons).items()):
            click.echo(f"  - {kind}: {n} task(s) (--expand or explain {run_id} KEY for each)")


@click.command()
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
    orc = base._ready_store()
    ids = list(run_ids) if run_ids else [v.id for v in orc.runs(limit)]
    problems = orc.verify(ids, allow_dead_letter=True, in_progress_ok=True)
    for line in problems:
        click.echo(f"violation: {line}")
    if problems:
        click.echo(f"{len(problems)} violation(s) in {len(ids)} run(s)", err=True)
        sys.exit(1)
    click.echo(f"{len(ids)} run(s) checked: no violation")
