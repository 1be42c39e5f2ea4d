"""The project's app as plain Celery: a result backend (``PLAIN_RESULT_BACKEND``) and results
kept, as a Celery team runs it before moving in. ``celery -A tests.integration.plain_celery
worker`` runs it; ``python -m tests.integration.plain_celery DAY FAILURES FAIL QUEUE`` applies
``tasks.canvas.workflow`` with it and prints the results of its steps as JSON, walking the final
result's parents (``stamp`` <- ``load`` <- ``aggregate``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from orchestrator.celery_app import get_app

app = get_app()
app.conf.update(result_backend=os.environ["PLAIN_RESULT_BACKEND"], task_ignore_result=False)


def main(argv: list[str]) -> None:
    from tasks.canvas import workflow

    day, failures, fail, queue = argv
    final = workflow(day, failures=failures, fail=fail == "1", queue=queue).apply_async()
    out: dict[str, Any] = {}
    try:
        out["stamp"] = final.get(timeout=120)
        out["load"] = final.parent.get(timeout=120)
        out["aggregate"] = final.parent.parent.get(timeout=120)
    except Exception as exc:  # noqa: BLE001 - a failed chain: its error is the output
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
