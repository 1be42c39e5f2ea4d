"""Bulk actions over HTTP, shared by the runs list's form (:mod:`.views.runs`) and the JSON API
(:mod:`.api.bulk`): the filter read from the request's form fields or query (``tag=KEY=VALUE``,
repeatable, ``state``, ``dag``, ``tenant``) with ``dry_run``, applied by ``orc.bulk``
(:mod:`orchestrator.engine.bulk`) as the credential's orchestrator (a tenant-bound credential
selects and acts on its tenant's runs only), each change recorded in its run's ledger with who
acted and from where: ``alice (web from 10.0.0.7)``."""

from __future__ import annotations

from ..engine.bulk import BulkReport
from .base import BaseHandler
from .params import flag, tag_filters


class BulkHandler(BaseHandler):
    """A POST that runs one bulk action (``cancel``, ``retry`` or ``rerun``)."""

    async def bulk(self, action: str) -> BulkReport:
        self.require_write()
        self.back = "/runs"  # the error page links back to the runs list
        tags = tag_filters(self.get_arguments("tag"))
        state = self.get_argument("state", "").strip() or None
        dag = self.get_argument("dag", "").strip() or None
        tenant = self.get_argument("tenant", "").strip() or None
        dry_run = flag(self, "dry_run")
        report: BulkReport = await self.blocking(
            self.orc.bulk.apply, action, tags=tags, state=state, dag=dag, tenant=tenant, dry_run=dry_run, by=self.by()
        )
        return report
