"""Child runs (``DAG.run_dag``): the engine's child pass and the submit-time checks.

A child-run node WAITS as a row (``orc_wait_v1``, kind ``child``) from the moment its rule says
READY. :meth:`ChildRuns.tick` (one step of every reconciler pass, and callable on its own) then:

1. **starts** the child of each waiting node whose attempt has none: the child DAG is built from
   what the node's row holds (a registered name and version, or a spec), in the parent run's
   tenant, and stored by an ordinary submit whose idempotency key is (parent run, key, attempt)
   and whose transaction also links the parent row (``ChildRows.link``: a compare-and-set on its
   state and attempt). A start repeated (two passes, a pass killed after the commit) finds the
   child by its key; a start for a node that moved on (cancelled, cleared) is rolled back whole.
   A child that cannot be built (its registered DAG gone, a spec that no longer validates) fails
   the node (``ChildRunRefused``);
2. **ends** each waiting node whose child run is final (``ChildRows.complete``);
3. **cancels** the running children whose policy is ``on_parent_end="cancel"`` and whose node no
   longer waits for them (``ChildRows.orphans``), each with a ``child_run`` ledger row on the node.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..core.children import ChildSpec, idempotency_key
from ..core.crashpoints import crash_point
from ..core.dag import DAG, dag_from_spec
from ..core.errors import DagNotFound, IdempotencyConflict, ValidationError
from ..core.models import RECONCILER
from ..core.routing import route
from ..store.children import ParentMoved, Pending

log = logging.getLogger(__name__)

#: nodes started, ended and orphans cancelled per pass, each
BATCH = 100


class ChildRuns:
    """``orc.children``: the child pass and the checks of a DAG's child-run nodes."""

    def __init__(self, orc: Any) -> None:
        self.orc = orc
        #: a check in progress: the child DAGs it builds are checked one level deep (a registered
        #: DAG that names itself, or two that name each other, would otherwise never end)
        self._local = threading.local()

    @property
    def rows(self) -> Any:
        return self.orc.store.children

    def check(self, dag: DAG) -> None:
        """At submit: each child-run node's DAG exists (a registered name and version, for the
        run's tenant) or validates (an inline spec, as a submit of it would). Raises
        :class:`ValidationError` naming the node; nothing is written."""
        if getattr(self._local, "checking", False):
            return
        self._local.checking = True
        try:
            for node in dag.nodes.values():
                spec = getattr(node, "child", None)
                if spec is None:
                    continue
                try:
                    self._build(spec, dag.tenant)
                except (ValidationError, DagNotFound) as exc:
                    raise ValidationError(f"run_dag: {exc}", dag=dag.name, node=node.key) from None
        finally:
            self._local.checking = False

    def _build(self, spec: ChildSpec, tenant: str) -> tuple[DAG, int | None]:
        """The child's DAG (its params laid over), checked as a submit checks it, and the
        registered version it was made from (None for a spec)."""
        if spec.name is not None:
            dag, found = self.orc.dags.build(spec.name, spec.version, params=dict(spec.params), tenant=tenant)
            version: int | None = found.version
        else:
            dag, version = dag_from_spec(dict(spec.spec or {})), None
            dag.params = {**dag.params, **dict(spec.params)}
        return self.orc.check(dag, tenant=tenant), version

    def tick(self) -> int:
        """One child pass (see the module); returns how many things it did."""
        done = 0
        for pending in self.rows.to_start(BATCH):
            try:
                done += int(self.start(pending))
            except Exception:
                log.exception("child runs: starting the child of %s.%s failed", pending.run_id, pending.key)
        for item in self.rows.finished(BATCH):
            try:
                self.orc.publisher.publish(self.rows.complete(item, self.orc.settings.dispatch_window))
                done += 1
            except Exception:
                log.exception("child runs: ending %s.%s with its child failed", item.run_id, item.key)
        for child_id, parent_run, parent_key in self.rows.orphans(BATCH):
            try:
                done += int(self.cancel_orphan(child_id, parent_run, parent_key))
            except Exception:
                log.exception("child runs: cancelling the child run %s failed", child_id)
        return done

    def start(self, pending: Pending) -> bool:
        """Start the child of one waiting node's attempt (idempotent); True when it was stored now."""
        spec = ChildSpec.from_row(pending.spec)
        settings, store = self.orc.settings, self.orc.store
        try:
            dag, version = self._build(spec, pending.tenant)
        except (ValidationError, DagNotFound) as exc:
            self.orc.publisher.publish(self.rows.refuse(pending, str(exc), settings.dispatch_window))
            return False
        dedicated = set(settings.dedicated_tenants) | set(store.tenants.dedicated())
        queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue, dedicated) for n in dag.nodes.values()}
        wants = {name: self.orc.registry.wants_upstream(name) for name in {n.task for n in dag.nodes.values()}}
        what = dag.name if version is None else f"{dag.name}@{version}"

        def link(conn: Any, run_id: str) -> None:
            # wait=False: the node succeeds here; what its end made READY is admitted below
            self.rows.link(conn, pending, run_id, spec.wait, what)

        try:
            _, created = store.submission.create_run(
                dag, queues=queues, wants_upstream=wants.__getitem__,
                idempotency_key=idempotency_key(pending.run_id, pending.key, pending.attempt),
                dag_version=version, default_max_active=settings.run_max_active_tasks or None,
                stripes=settings.fanin_stripes,
                parent=(pending.run_id, pending.key, pending.attempt), link=link,
            )  # fmt: skip
        except (ParentMoved, IdempotencyConflict) as exc:
            log.info("child runs: %s.%s attempt %s: %s", pending.run_id, pending.key, pending.attempt, exc)
            return False
        if created:
            crash_point("after_child_commit")
            self.orc.publisher.publish(store.admission.admit_ready(settings.dispatch_window))
        return bool(created)

    def cancel_orphan(self, child_id: str, parent_run: str, parent_key: str) -> bool:
        """Cancel a running child whose node no longer waits for it (``on_parent_end="cancel"``)."""
        revoke, conflict, already = self.orc.store.operator.cancel_run(child_id, RECONCILER)
        if conflict is not None or already:
            return False
        self.rows.note_cancel(child_id, parent_run, parent_key)
        if revoke:
            self.orc.publisher.publish(self.orc.store.admission.admit_ready(self.orc.settings.dispatch_window))
            self.orc.publisher.revoke(revoke)
        return True

    def lineage(self, run_id: str) -> dict[str, Any]:
        """A run's parent and child runs (``ChildRows.lineage``), for ``status`` and the run page."""
        lineage: dict[str, Any] = self.rows.lineage(run_id)
        return lineage
