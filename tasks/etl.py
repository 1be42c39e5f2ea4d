"""The demo's ETL tasks: two extracts (one flaky), two cleans, an aggregate, a load.

Each task that declares ``upstream`` receives its parents' results by node key.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.celery_app import get_app
from orchestrator.worker import current_context

app = get_app()
STEP = 0.3  # seconds each step takes, so the demo's progress is visible


class SourceUnavailable(RuntimeError):
    """The customers source timed out (the demo's transient failure)."""


@app.task
def extract_orders(day: str) -> list[dict[str, Any]]:
    time.sleep(STEP)
    return [{"order": i, "customer": i % 3, "amount": round(10 + i * 2.5, 2), "day": day} for i in range(6)]


@app.task
def extract_customers(day: str, fail_first: int = 1) -> list[dict[str, Any]]:
    time.sleep(STEP)
    ctx = current_context()
    if ctx is not None and ctx.attempt <= fail_first:
        raise SourceUnavailable(f"customers API timed out on attempt {ctx.attempt}")
    return [{"customer": c, "name": n} for c, n in enumerate(["ada", "grace", "edsger"])]


@app.task
def clean_orders(upstream: dict[str, Any]) -> list[dict[str, Any]]:
    time.sleep(STEP)
    return [o for o in upstream["extract_orders"] if o["amount"] > 0]


@app.task
def clean_customers(upstream: dict[str, Any]) -> dict[str, str]:
    time.sleep(STEP)
    return {str(c["customer"]): c["name"].title() for c in upstream["extract_customers"]}


@app.task
def aggregate(upstream: dict[str, Any]) -> dict[str, float]:
    time.sleep(STEP)
    names = upstream["clean_customers"]
    totals: dict[str, float] = {}
    for order in upstream["clean_orders"]:
        name = names[str(order["customer"])]
        totals[name] = round(totals.get(name, 0.0) + order["amount"], 2)
    return totals


@app.task
def load(upstream: dict[str, Any], table: str = "revenue_by_customer") -> dict[str, Any]:
    time.sleep(STEP)
    rows = upstream["aggregate"]
    return {"table": table, "rows": len(rows), "total": round(sum(rows.values()), 2)}
