"""``orc.tenants``: tenants' weights in the fair share of admission, their limits and dedicated
queues (stored by :mod:`orchestrator.store.tenants`)."""

from __future__ import annotations

import math

from ..core.errors import ValidationError
from .scope import Host, own_tenant


class Tenants:
    """The tenants API of one :class:`~orchestrator.engine.Orchestrator` (``orc.tenants``); a
    tenant-bound orchestrator changes and sees its own tenant only."""

    def __init__(self, orc: Host) -> None:
        self.orc = orc

    def set_weight(self, name: str, weight: float) -> None:
        """A tenant's weight in the fair share of admission (default 1): within a priority class,
        free slots go to the tenant with the fewest tasks in flight per unit of weight. Raises
        :class:`ValidationError` for a bad name or a weight that is not a number in (0, 1000]."""
        own_tenant(self.orc.tenant, name)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or not 0 < weight <= 1000
        ):
            raise ValidationError(f"weight {weight!r} must be a number above 0 and at most 1000")
        self.orc.store.tenants.update(name, weight=float(weight))

    def set_limit(self, name: str, max_running: int | None) -> None:
        """The most tasks of tenant ``name`` QUEUED or RUNNING at once across every queue
        (``None``: no limit), enforced at admission and counted from the task rows, so a slot
        is free again as soon as its task ends, its lease expires or its run is cancelled.
        Raises :class:`ValidationError` for a bad name or a limit that is not 1 to 1,000,000."""
        own_tenant(self.orc.tenant, name)
        if max_running is not None and (
            isinstance(max_running, bool) or not isinstance(max_running, int) or not 1 <= max_running <= 1_000_000
        ):
            raise ValidationError(f"max_running {max_running!r} must be an integer from 1 to 1000000")
        orc = self.orc
        orc.store.tenants.update(name, max_running=max_running)
        # a raised limit frees slots: fill them now
        orc.publisher.publish(orc.store.admission.admit_ready(orc.settings.dispatch_window))

    def set_dedicated(self, name: str, dedicated: bool = True) -> None:
        """Give tenant ``name`` its own queues (``orchestrator.tenant.<name>.<priority>``) from
        its next submit on, served by workers started with ``orchestrator worker --tenant
        <name>``; ``dedicated=False`` sends its new runs back to the shared queues. Tenants in
        ``ORCHESTRATOR_DEDICATED_TENANTS`` are dedicated too."""
        own_tenant(self.orc.tenant, name)
        self.orc.store.tenants.update(name, dedicated=bool(dedicated))

    def all(self) -> dict[str, tuple[float, int | None, bool]]:
        """``{tenant: (weight, max_running, dedicated)}`` of the tenants configured so far (a
        tenant-bound orchestrator sees its own entry only)."""
        found = self.orc.store.tenants.settings()
        if self.orc.tenant is not None:
            return {name: v for name, v in found.items() if name == self.orc.tenant}
        return found
