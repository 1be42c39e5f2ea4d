"""``orc.breakers``: circuit breakers per resource (stored by :mod:`orchestrator.store.breakers`;
the counting and holding are server functions). Deployment-wide."""

from __future__ import annotations

from collections.abc import Sequence

from ..store.breakers import Breaker, BreakerEvent
from ..store.breakers import Breakers as BreakerRows
from .scope import Host, deployment_wide, local_by


class Breakers:
    """The breakers API of one :class:`~orchestrator.engine.Orchestrator` (``orc.breakers``): a
    tenant-bound orchestrator is refused (:class:`ValidationError`), for reads too. A change that
    may free tasks admits READY ones at once."""

    def __init__(self, orc: Host) -> None:
        self.orc = orc

    def _rows(self) -> BreakerRows:
        return self.orc.store.breakers.scoped(self.orc.tenant)

    def _change(self) -> BreakerRows:
        deployment_wide(self.orc.tenant, "breakers")
        return self.orc.store.breakers

    def _admit(self) -> None:
        orc = self.orc
        orc.publisher.publish(orc.store.admission.admit_ready(orc.settings.dispatch_window))

    def set(
        self,
        name: str,
        *,
        window: str | float = 60.0,
        min_calls: int = 20,
        failure_rate: float = 0.5,
        min_failures: int = 5,
        open_for: str | float = "30s..10m",
        probes: int = 1,
        probe_lease: str | float | None = None,
        ramp_max: int = 64,
        failure_on: Sequence[str] = (),
        mode: str = "on",
        by: str | None = None,
    ) -> Breaker:
        """Create or change the circuit breaker of the resource ``name`` (tasks declare
        ``resources=[...]``): it trips when its last ``window`` (``"60s"``) holds at least
        ``min_calls`` calls, ``min_failures`` failures (time-outs, connection errors, the
        exception classes named in ``failure_on``) and a ``failure_rate`` share of failures; open,
        admission holds the resource's READY tasks for ``open_for`` (``"30s..10m"``: doubled per
        consecutive re-open); half-open, ``probes`` leased probes decide; closed again, admission
        ramps up in waves of 1, 2, 4 ... up to ``ramp_max``. ``mode``: on, metrics (counts, never
        holds) or disabled."""
        found = self._change().set(
            name, window=window, min_calls=min_calls, failure_rate=failure_rate, min_failures=min_failures,
            open_for=open_for, probes=probes, probe_lease=probe_lease, ramp_max=ramp_max, failure_on=failure_on,
            mode=mode, by=by or local_by(),
        )  # fmt: skip
        self._admit()
        return found

    def get(self, name: str) -> Breaker:
        """The breaker ``name`` now: settings, state, its window's calls and failures, probes out."""
        return self._rows().get(name)

    def all(self) -> list[Breaker]:
        return self._rows().find()

    def events(self, name: str | None = None, *, limit: int = 100) -> list[BreakerEvent]:
        """The breakers' ledger (every state change and operator action, with who), oldest first."""
        return self._rows().events(name, limit=limit)

    def open(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Force the breaker open (its resource's READY tasks are held) until :meth:`close`."""
        return self._change().open(name, by=by or local_by(), reason=reason)

    def close(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """Close the breaker now (no ramp) and turn it back on; its held tasks are admitted."""
        found = self._change().close(name, by=by or local_by(), reason=reason)
        self._admit()
        return found

    def disable(self, name: str, *, by: str | None = None, reason: str | None = None) -> Breaker:
        """The breaker never trips and counts nothing (until set or closed again)."""
        found = self._change().disable(name, by=by or local_by(), reason=reason)
        self._admit()
        return found

    def remove(self, name: str, *, by: str | None = None) -> bool:
        """Remove the breaker: its resource's tasks are no longer counted nor held."""
        gone = self._change().remove(name, by=by or local_by())
        self._admit()
        return gone
