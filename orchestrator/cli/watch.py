"""``orchestrator watch RUN_ID``: a live terminal view of a run, read from the database.

A progress bar (final tasks of all), the count per state, the running tasks with their
worker and time so far, and the newest ledger events, redrawn every ``poll`` seconds with
`rich <https://rich.readthedocs.io>`_ until the run is final. ``submit --wait`` uses it on a
terminal; piped, both print one line per change instead (:func:`orchestrator.cli.demo.follow`).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..core.models import EventView, ProgressView, RunView, TaskView
from ..core.states import RunState, TaskState

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

#: rich styles by state (the run page's colours, as near as a terminal gets)
STYLES: dict[str, str] = {
    "PENDING": "white",
    "READY": "cyan",
    "QUEUED": "blue",
    "RUNNING": "bright_green",
    "RETRYING": "yellow",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "UPSTREAM_FAILED": "dark_orange",
    "SKIPPED": "magenta",
    "CANCELLED": "bright_black",
    "DEAD_LETTER": "bold red",
    "MAPPED": "bright_cyan",
}
RECENT_EVENTS = 8
RUNNING_ROWS = 12
#: the most maps listed with their children's counts
MAP_ROWS = 8


def view(
    run: RunView, tasks: list[TaskView], events: list[EventView], now: dt.datetime | None = None,
    progress: dict[str, ProgressView] | None = None,
) -> Group:  # fmt: skip
    """One frame: header, progress bar, counts per state, running tasks (with what each body last
    reported, ``update_state``'s ``progress``), recent events."""
    progress = progress or {}
    now = now or dt.datetime.now(dt.UTC)
    total = len(tasks) or 1
    done = sum(t.state.terminal for t in tasks)
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t.state.value] = counts.get(t.state.value, 0) + 1
    head = Text.assemble(
        ("run ", "bold"),
        run.id,
        "  dag ",
        (run.dag, "bold"),
        f"  tenant {run.tenant}  ",
        (run.state.value, STYLES.get(run.state.value, "white") if run.state is not RunState.RUNNING else "bold"),
        ("  needs attention" if run.needs_attention else "", "bold red"),
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=total, completed=done, width=40), Text(f"{done}/{len(tasks)} final"))
    tally = Text("  ").join(
        Text(f"{state.value.lower()} {counts[state.value]}", style=STYLES[state.value])
        for state in TaskState
        if counts.get(state.value)
    )
    running = Table(title="running", title_justify="left", show_edge=False, expand=False)
    for column in ("task", "attempt", "worker", "for", "progress"):
        running.add_column(column)
    busy = [t for t in tasks if t.state is TaskState.RUNNING]
    for t in busy[:RUNNING_ROWS]:
        since = (now - t.started_at).total_seconds() if t.started_at else 0.0
        said = progress.get(t.key)
        told = f"{said.state} {json.dumps(said.meta, separators=(',', ':'))}"[:60] if said else ""
        running.add_row(Text(t.key), str(t.attempt), Text(t.worker or ""), f"{since:.1f}s", Text(told))
    if len(busy) > RUNNING_ROWS:
        running.add_row(f"... {len(busy) - RUNNING_ROWS} more", "", "", "", "")
    maps = [t for t in tasks if t.map_counts is not None and t.map_counts["total"]]
    mapped = Table(title="maps", title_justify="left", show_edge=False, expand=False)
    for column in ("map", "state", "children"):
        mapped.add_column(column)
    for t in maps[:MAP_ROWS]:
        c = t.map_counts or {}
        mapped.add_row(
            Text(t.key),
            Text(t.state.value, style=STYLES.get(t.state.value, "white")),
            f"{c['done']:,}/{c['total']:,} done: {c['succeeded']:,} ok, {c['failed']:,} failed,"
            f" {c['skipped']:,} skipped",
        )
    if len(maps) > MAP_ROWS:
        mapped.add_row(f"... {len(maps) - MAP_ROWS} more", "", "")
    recent = Table(title="recent events", title_justify="left", show_edge=False)
    for column in ("at", "task", "change", "actor", "reason"):
        recent.add_column(column, overflow="fold")
    for e in events[-RECENT_EVENTS:]:
        change = f"{e.from_state or '-'} -> {e.to_state}" + ("" if e.accepted else " (refused)")
        if e.kind:
            change = e.kind
        at = e.at.strftime("%H:%M:%S") if e.at else ""
        who = e.actor + (f" ({e.by})" if e.by else "")
        recent.add_row(at, Text(e.key or "(run)"), change, Text(who), Text((e.reason or "")[:60]))
    return Group(Panel(head), bar, tally, running, *([mapped] if maps else []), recent)


def watch(
    orc: Orchestrator, run_id: str, *, poll: float = 0.5, timeout: float | None = None, console: Console | None = None
) -> RunState:
    """Redraw the run until it is final (or ``timeout`` seconds pass); return its state."""
    console = console or Console()
    start = time.monotonic()

    def frame() -> tuple[Group, RunState]:
        run = orc.visible(run_id)
        tasks, events = orc.tasks(run_id), orc.ledger(run_id, newest=RECENT_EVENTS)
        return view(run, tasks, events, progress=orc.progress(run_id)), run.state

    shown, state = frame()
    with Live(shown, console=console, refresh_per_second=4, transient=False) as live:
        while not state.terminal:
            if timeout is not None and time.monotonic() - start > timeout:
                break
            time.sleep(poll)
            shown, state = frame()
            live.update(shown)
    return state
