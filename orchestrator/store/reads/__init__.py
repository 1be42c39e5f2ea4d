"""Reads: runs, tasks and the ledger as domain values, and the raw rows the invariant
checker and the chaos soak inspect. One module per concept, one :class:`Reads` port:

* :mod:`.runs` - a run and the runs list;
* :mod:`.tasks` - a run's tasks, edges and ledger, whole and paged (the web UI, the JSON API);
* :mod:`.drawing` - what the web app's DAG drawing needs (plain rows through the driver);
* :mod:`.explain` - the input of ``explain``;
* :mod:`.diagnostics` - the rows and counts the invariant checker, the kit and the soak read;
* :mod:`.metrics` - the Prometheus metrics' one snapshot;
* :mod:`.workers` - the live workers (``orchestrator workers``);
* :mod:`.base` - the database, the tenant and the gates they share.

A :class:`Reads` may be scoped to a tenant (:meth:`Reads.scoped`, what an orchestrator bound to
a tenant reads through): then every read of one run is gated in its own query (``WHERE id = :run
AND tenant = :tenant``), so a run of another tenant is :class:`RunNotFound` exactly like a run
that does not exist, whoever the caller is and whatever it remembers; the runs list, the metrics
and explain keep to the tenant's rows, and the workers list does not show other tenants'
dedicated queues.
"""

from __future__ import annotations

from .diagnostics import DiagnosticReads, Snapshot
from .drawing import DrawingReads
from .explain import OTHERS, ExplainReads
from .metrics import MetricsReads
from .runs import RUN_VIEW_COLUMNS, RunReads
from .tasks import TaskPage, TaskReads
from .workers import WorkerReads, WorkerView

__all__ = ["OTHERS", "RUN_VIEW_COLUMNS", "Reads", "Snapshot", "TaskPage", "WorkerView"]


class Reads(RunReads, TaskReads, DrawingReads, ExplainReads, DiagnosticReads, MetricsReads, WorkerReads):
    """The store's read port (see the module's docstring)."""

    def scoped(self, tenant: str | None) -> Reads:
        """These reads as ``tenant`` sees them (``None``: every tenant)."""
        return self if tenant == self.tenant else Reads(self.db, tenant=tenant)
