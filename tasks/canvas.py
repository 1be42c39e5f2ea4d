"""A Celery team's canvas workflow, unchanged: the same task bodies run under plain Celery
(``workflow(day).apply_async()``) and under the orchestrator (``orchestrator.submit(workflow(day))``).

``extract`` reads a day's rows, four ``transform`` parts each sum a slice, ``aggregate`` (a chord's
body) adds the parts, ``load`` stores the total. ``notify_failure`` is an error callback
(``link_error``), Celery's new style: it gets the failed task's request, its exception and the
traceback, then its own arguments (a file it appends a line to)."""

from __future__ import annotations

import json
import time
from typing import Any

from celery import chain, chord, group

from orchestrator.celery_app import get_app

app = get_app()
PARTS = 4


@app.task
def extract(day: str, rows: int = 12, fail: bool = False) -> list[dict[str, Any]]:
    if fail:
        raise ValueError(f"no rows for {day}")
    return [{"day": day, "n": i, "amount": 10 + i} for i in range(rows)]


@app.task
def transform(rows: list[dict[str, Any]], part: int, parts: int = PARTS, pause: float = 0.0) -> dict[str, Any]:
    """Sum the ``part``-th slice of ``rows`` (after ``pause`` seconds: the fault tests kill it mid-way)."""
    if pause:
        time.sleep(pause)
    mine = rows[part::parts]
    return {"part": part, "count": len(mine), "amount": sum(r["amount"] for r in mine)}


@app.task
def aggregate(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "order": [p["part"] for p in parts],
        "count": sum(p["count"] for p in parts),
        "amount": sum(p["amount"] for p in parts),
    }


@app.task
def load(total: dict[str, Any], table: str) -> dict[str, Any]:
    return {"table": table, **total}


@app.task
def stamp(label: str) -> str:
    """An immutable step (``.si()``): it ignores what came before."""
    return f"stamped {label}"


@app.task
def notify_failure(request: Any, exc: BaseException, traceback: Any, path: str) -> None:
    """Append the failed task's name, id and error to ``path`` (one JSON line)."""
    line = {"task": request.task, "id": request.id, "error": type(exc).__name__, "message": str(exc)}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def workflow(day: str, *, failures: str, fail: bool = False, queue: str = "celery", pause: float = 0.0) -> Any:
    """The canvas: ``extract`` (on ``queue``) -> four ``transform`` parts -> ``aggregate`` (a chord)
    -> ``load``, then an immutable ``stamp``; an error callback on the chain."""
    return chain(
        extract.s(day, fail=fail).set(queue=queue),
        chord(group(transform.s(part=i, pause=pause) for i in range(PARTS)), aggregate.s()),
        load.s(table="revenue"),
        stamp.si("done"),
    ).on_error(notify_failure.s(failures))
