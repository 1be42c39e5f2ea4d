"""Keyed flow control, the engine's side (:mod:`orchestrator.core.flow`, :mod:`orchestrator.store.flow`):
what a submit does after its transaction (the runs ``on_busy="cancel_running"`` displaced are
cancelled, then the key's held runs released) and the reconciler's flow pass (held runs released,
their first tasks admitted and published)."""

from __future__ import annotations

from typing import Any

from ..core.explain import Explanation, Reason
from ..core.flow import FlowControl
from ..core.models import Actor
from ..store.flow import Decision


def release(orc: Any) -> int:
    """The reconciler's flow pass: held runs whose key freed, whose throttle slot came or whose
    debounce went quiet are released (a compare-and-set each); their READY roots are admitted."""
    released = int(orc.store.flow.release())
    if released:
        orc.publisher.publish(orc.store.admission.admit_ready(orc.settings.dispatch_window))
    return released


def displace(orc: Any, run_id: str, key: str, running: list[str]) -> None:
    """``on_busy="cancel_running"``: cancel the key's admitted runs (as an operator's cancel: their
    attempts in flight revoked), then release what the key holds (``run_id`` first in line)."""
    actor = Actor("operator", by=f"run {run_id} (concurrency key {key}, on_busy=cancel_running)")
    for other in running:
        in_flight, _conflict, _ = orc.store.operator.cancel_run(other, actor)
        orc.publisher.revoke(in_flight)
    release(orc)


class Keyed:
    """A keyed submit's part in :func:`orchestrator.engine.submitting.submit_run`: ``hold`` and
    ``link`` run in the submit's transaction (``create_run``), ``after`` once it committed."""

    def __init__(self, orc: Any, tenant: str, flow: FlowControl) -> None:
        self.orc, self.tenant, self.flow = orc, tenant, flow
        self.decision = Decision()

    def hold(self, conn: Any, run_id: str, row: dict[str, Any]) -> bool:
        # a retried transaction decides again: the last decision is the committed one
        self.decision = self.orc.store.flow.decide(conn, run_id, self.tenant, self.flow, row)
        return self.decision.held is not None

    def link(self, conn: Any, run_id: str) -> None:
        self.orc.store.flow.settle(conn, run_id, self.decision)

    def after(self, run_id: str) -> bool:
        """After the commit: the displaced runs cancelled (``cancel_running``); whether the run
        was admitted (its first tasks are to be admitted and published)."""
        if self.decision.cancel:
            displace(self.orc, run_id, self.flow.key, self.decision.cancel)
        return self.decision.held is None

    @property
    def warnings(self) -> list[str]:
        """The handle's word on a held or skipped run (its reason)."""
        return [self.decision.reason] if self.decision.reason else []


def held_reasons(orc: Any, run_id: str, found: list[Explanation]) -> list[Explanation]:
    """``explain`` of a held run: each task's first reason says why the run is held (``held``:
    ``held by concurrency key K (1 running: ID)``, ``throttled: next slot at T``, ``debounced until T``,
    ``batching until T``)."""
    why = orc.store.flow.why_held(run_id) if found else None
    if why is None:
        return found
    return [Explanation(e.key, e.state, [Reason("held", why), *e.reasons]) for e in found]
