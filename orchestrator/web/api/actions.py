"""``POST /api/runs/RUN_ID/cancel|rerun`` and ``POST /api/runs/RUN_ID/tasks/KEY/ACTION``:
an operator action (:mod:`orchestrator.web.actions`) answered as JSON."""

from __future__ import annotations

from ..actions import ActionHandler


class ApiAction(ActionHandler):
    api = True

    async def post(self, run_id: str, key: str | None = None, action: str = "cancel") -> None:
        done = await self.act(run_id, key, action)
        self.write({"ok": True, "run": run_id, "key": key, "action": action, "done": done.text, **done.extra})
