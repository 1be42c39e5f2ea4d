"""``orchestrator bulk cancel|retry|rerun``: one operator action on every run a filter selects
(``--tag KEY=VALUE``, ``--state``, ``--dag``), through the per-run operations
(:mod:`orchestrator.engine.bulk`); ``--dry-run`` prints what would change and writes nothing."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import base
from .base import _by, _dump

#: how each outcome is printed at the head of its line
VERBS = {
    "cancel": {"planned": "would cancel", "done": "cancelled"},
    "retry": {"planned": "would retry", "done": "retried"},
    "rerun": {"planned": "would rerun", "done": "rerun"},
}

HELP = {
    "cancel": """Cancel every RUNNING run the filter selects (as `orchestrator cancel` does each: open tasks
    become CANCELLED, running ones are revoked). A run already final is skipped, with the reason.""",
    "retry": """Run the failed tasks of every run the filter selects again: each DEAD_LETTER task is retried
    (as `orchestrator retry`), the FAILED ones are cleared with their FAILED and UPSTREAM_FAILED
    downstream (as `orchestrator clear --downstream --only-failed`), and a FAILED run reopens. A run
    with no failed task, a SUCCEEDED or a CANCELLED run is skipped, with the reason.""",
    "rerun": """Start a new run of every finished run the filter selects (as `orchestrator rerun` does each:
    the same DAG snapshot, params and tags, linked to it). A RUNNING run is skipped.""",
}

EPILOG = """Prints one line per selected run (what it would get or got, or why it was skipped) and a
count. At least one filter is needed: --tag (repeatable, a run must hold every one), --state or
--dag; at most 1,000 runs match one action. Each change is recorded in the run's ledger with who
acted (`user@host (cli)`). As a tenant (orchestrator --tenant T bulk ...), only that tenant's runs
are selected. Exits 1 when an operation was refused for a run (another writer changed it first),
2 for a bad or missing filter (nothing is touched)."""


def _line(action: str, item: Any) -> str:
    verb = VERBS[action].get(item.outcome, item.outcome)
    tags = " ".join(f"{k}={v}" for k, v in sorted(item.tags.items()))
    return f"{verb:<12}  {item.run_id}  {item.dag}  {item.state:<9}  {tags or '-'}  {item.detail}"


def _command(action: str) -> click.Command:
    @click.command(name=action, help=HELP[action], epilog=EPILOG)
    @click.option(
        "--tag", "tag_items", multiple=True, metavar="KEY=VALUE",
        help="Only runs holding this tag (repeatable: every one).",
    )  # fmt: skip
    @click.option("--state", default=None, help="Only runs in this state (RUNNING, SUCCEEDED, FAILED, CANCELLED).")
    @click.option("--dag", default=None, metavar="NAME", help="Only runs of this DAG.")
    @click.option("--tenant", default=None, help="Only this tenant's runs (it narrows a filter; it is none alone).")
    @click.option("--dry-run", is_flag=True, help="Print what would change; write nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
    def run(
        tag_items: tuple[str, ...], state: str | None, dag: str | None, tenant: str | None, dry_run: bool, as_json: bool
    ) -> None:
        from ..core.tags import parse_tag_filters

        tags = parse_tag_filters(tag_items)
        report = base._ready_store().bulk.apply(
            action, tags=tags, state=state, dag=dag, tenant=tenant, dry_run=dry_run, by=_by()
        )
        if as_json:
            _dump(report.to_json())
        else:
            for item in report.items:
                click.echo(_line(action, item))
            click.echo(report.summary())
        if report.count("failed"):
            sys.exit(1)

    return run


@click.group()
def bulk() -> None:
    """Cancel, retry or rerun every run a filter selects (--tag KEY=VALUE, --state, --dag); --dry-run
    first to see what would change."""


for _action in ("cancel", "retry", "rerun"):
    bulk.add_command(_command(_action))
