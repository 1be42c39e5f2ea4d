"""Operator actions on a run or a task, shared by the run page's forms
(:mod:`.views.run`) and the JSON API (:mod:`.api.actions`): retry / skip / fail a task, clear it
(with its downstream or not), mark it success / failed / skipped, approve or reject a wait,
cancel the run or rerun it. Each acts as the credential's orchestrator (its tenant's runs only)
and is recorded in the ledger with who acted and from where: ``alice (web from 10.0.0.7)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ..core.errors import ValidationError
from ..core.states import TaskState
from .base import BaseHandler
from .params import flag

ACTIONS = ("retry", "skip", "fail", "clear", "mark", "approve", "reject")

#: what a mark may set (the form's ``state``): the page's words, and the states' own names
MARKS = {"success": TaskState.SUCCEEDED, "failed": TaskState.FAILED, "skipped": TaskState.SKIPPED}

#: the most cleared keys a clear's banner names (the JSON answer holds them all)
CLEARED_SHOWN = 10


def _mark_state(handler: BaseHandler) -> TaskState:
    raw = handler.get_argument("state", "").strip()
    found = MARKS.get(raw.lower())
    if found is None and raw.upper() in {s.value for s in MARKS.values()}:
        found = TaskState(raw.upper())
    if found is None:
        shown = f"not {raw[:40]!r}" if raw else "it is missing"
        raise ValidationError(f"a mark's state must be success, failed or skipped ({shown})")
    return found


@dataclass(frozen=True)
class Done:
    """An action's outcome: the banner's words, what the JSON answer adds, and the run whose page
    the browser goes on to (a rerun's new run; else the run acted on)."""

    text: str
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)


class ActionHandler(BaseHandler):
    """The run page's forms and the JSON API's POSTs: one action each, as the credential's
    orchestrator (its tenant's runs only), recorded with :meth:`by`."""

    async def act(self, run_id: str, key: str | None, action: str) -> Done:
        self.require_write()
        self.back = f"/runs/{quote(run_id)}"  # the error page links back to the run
        by = self.by()
        orc = self.orc
        if key is None and action == "rerun":
            handle = await self.blocking(orc.rerun, run_id)
            url = f"/runs/{quote(handle.id)}"
            return Done(f"new run {handle.id}: a rerun of {run_id}", handle.id, {"rerun": handle.id, "url": url})
        if key is None:
            revoked = await self.blocking(orc.cancel, run_id, by=by)
            return Done(f"run cancelled; {revoked} task(s) revoked", run_id)
        if action == "clear":
            downstream = flag(self, "downstream")
            setup = not flag(self, "no_setup")  # the setups it works under and their teardowns, as Airflow
            cleared: list[str] = await self.blocking(orc.clear, run_id, key, downstream=downstream, by=by, setup=setup)
            shown = ", ".join(cleared[:CLEARED_SHOWN]) + (
                f" and {len(cleared) - CLEARED_SHOWN:,} more" if len(cleared) > CLEARED_SHOWN else ""
            )
            what = " with its downstream" if downstream else ""
            return Done(f"{key}: cleared{what}, {len(cleared):,} task(s) to run again: {shown}", run_id,
                        {"cleared": cleared, "downstream": downstream})  # fmt: skip
        if action == "mark":
            to = _mark_state(self)
            held: TaskState = await self.blocking(orc.mark, run_id, key, to, by=by)
            return Done(f"{key}: marked {to.value} (was {held.value})", run_id, {"state": to.value, "was": held.value})
        if action in ("approve", "reject"):
            comment = self.get_argument("comment", "").strip() or None
            answer = orc.approve if action == "approve" else orc.reject
            await self.blocking(answer, run_id, key, by=by, comment=comment)
            return Done(f"{key}: {action}d", run_id, {"comment": comment})
        fn = {"retry": orc.retry_task, "skip": orc.skip_task, "fail": orc.fail_task}[action]
        await self.blocking(fn, run_id, key, by=by)
        return Done(f"{key}: {action} done", run_id)
