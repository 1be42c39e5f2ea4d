"""``orc.limits``: pools, deployment-wide rate limits and per-DAG limits (stored by
:mod:`orchestrator.store.limits`; enforced at admission, counted from the task rows)."""

from __future__ import annotations

from ..core.models import Pool, RateLimit
from ..core.routing import DEFAULT_TENANT
from .scope import Host, deployment_wide, own_tenant


class Limits:
    """The limits API of one :class:`~orchestrator.engine.Orchestrator` (``orc.limits``). A change
    that may free slots admits READY tasks at once."""

    def __init__(self, orc: Host) -> None:
        self.orc = orc

    def _admit(self) -> None:
        orc = self.orc
        orc.publisher.publish(orc.store.admission.admit_ready(orc.settings.dispatch_window))

    def set_pool(self, name: str, slots: int, description: str | None = None) -> None:
        """Define or resize the named pool (like an Airflow pool): tasks that name it
        (``pool=``) hold ``pool_slots`` of its slots each while QUEUED or RUNNING, counted from
        the task rows at admission. Deployment-wide: an orchestrator bound to a tenant cannot
        change it. Raises :class:`ValidationError` for a bad name or slot count."""
        deployment_wide(self.orc.tenant, "pools")
        self.orc.store.limits.set_pool(name, slots, description)
        self._admit()

    def remove_pool(self, name: str) -> bool:
        """Remove a pool; tasks that still name it wait (``explain`` says so) until it is set again."""
        deployment_wide(self.orc.tenant, "pools")
        return self.orc.store.limits.remove_pool(name)

    def pools(self) -> list[Pool]:
        return self.orc.store.limits.pools()

    def set_rate_limit(self, key: str, rate: str | float, burst: int | None = None) -> RateLimit:
        """Define or change a deployment-wide token bucket: ``rate`` like ``"10/s"``, ``"600/m"``
        (or tokens per second), ``burst`` its size (default one second's worth, at least 1).
        Tasks that name it (``rate_limit=``) take one token each when admitted, on every
        worker together (Celery's own ``rate_limit`` is per worker process)."""
        deployment_wide(self.orc.tenant, "rate limits")
        limit = self.orc.store.limits.set_rate_limit(key, rate, burst)
        self._admit()
        return limit

    def remove_rate_limit(self, key: str) -> bool:
        """Remove a rate limit; tasks that still name it wait until it is set again."""
        deployment_wide(self.orc.tenant, "rate limits")
        return self.orc.store.limits.remove_rate_limit(key)

    def rate_limits(self) -> list[RateLimit]:
        return self.orc.store.limits.rate_limits()

    def set_dag_limit(self, dag_name: str, max_running: int | None, *, tenant: str | None = None) -> None:
        """The most tasks QUEUED or RUNNING at once across every run of one tenant's DAG
        (``None``: no limit); ``tenant`` defaults to the bound tenant, else the default tenant.
        (A single run's limit is the DAG's ``max_active_tasks``.)"""
        name = tenant or self.orc.tenant or DEFAULT_TENANT
        own_tenant(self.orc.tenant, name)
        self.orc.store.limits.set_dag_limit(name, dag_name, max_running)
        self._admit()

    def dag_limits(self) -> dict[tuple[str, str], int]:
        """``{(tenant, DAG name): max_running}`` (the bound tenant's only, when bound)."""
        return self.orc.store.limits.dag_limits(self.orc.tenant)
