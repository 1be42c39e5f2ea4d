"""Persistence: the database is the source of truth.

The store is a set of roles composed over one :class:`Database`, each in its own module:

========================  ==============================================================
``ledger.Ledger``         the one writer of task and run state (CAS + event, accepted or
                          rejected); every other role changes state through it
``submission``            a DAG becomes a run, tasks, edges and first events
``flow``                  keyed flow control: a run admitted or held by its key (CAS on
                          ``held``), held runs released by the reconciler's flow pass
``admission``             READY -> QUEUED within the live workers' capacity
``settlement``            counters, trigger rules, cascades, closing the run
``attempts``              the worker side: claim, heartbeat (the lease), fenced outcome
``hotpath``               on Postgres, the claim and the success as one server-function call
``recovery``              the reconciler's actions: due retries, lost dispatches, leases
``deadlines``             the reconciler's verdict on deadlines that fell due; misses
                          recorded once (CAS + ``deadline_missed`` event), and read
``operator``              retry, give up, skip, cancel (``scoped(tenant)``: a tenant's runs only)
``reads``                 runs, tasks and the ledger as domain values; diagnostics
                          (``scoped(tenant)``: a tenant's runs only)
``workers``               the worker registry (capacity of live workers)
``deliveries``            redelivered broker messages counted, parked ones with evidence
``tenants``               tenants' weights in the fair share of admission, their limits
``limits``                pools, rate limits (token buckets), per-DAG limits
``breakers``              circuit breakers per resource: settings, operator actions, ledger
``children``              child runs (``DAG.run_dag``): nodes to start, the parent-child
                          link (CAS), the node ended with its child, orphans by policy
``schedules``             ``Store.schedule_rows``: schedules and their firings (decided under
                          each schedule's row lock; ``scoped(tenant)``: a tenant's only)
``rows``                  rows -> domain values (the only place)
``backend``               what is Postgres-specific: engines (and the embedded server's
                          ``embedded://`` URL), COPY, the reconciler's duty lock
``functions``             the server functions' one home, ``sql/*.sql`` (claim, succeed,
                          settle, admit, admit_from, pass_slot, limit_held, reject, decide),
                          versioned ``orc_<name>_v<N>``; migrations install frozen copies
========================  ==============================================================

Times come from the database (``dbtime``). :class:`Store` wires the roles together.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from functools import cached_property

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from . import schema as s
from .admission import Admission
from .attempts import Attempts
from .backend import DEFAULT_POOL_SIZE, make_engine
from .breakers import Breakers
from .children import ChildRows
from .cleanup import Cleanup
from .dags import DagRows
from .database import Database, new_run_id
from .deadlines import Deadlines
from .deliveries import Deliveries
from .flow import FlowRows
from .ledger import Ledger
from .limits import Limits
from .operator import OperatorActions
from .progress import ProgressRows
from .reads import Reads
from .recovery import Recovery
from .schedules import ScheduleRows
from .settlement import Settlement
from .submission import Submission
from .tenants import Tenants
from .triggers import TriggerRows
from .waits import Waits
from .workers import WorkerRegistry


class Store:
    """The roles of the store over one Postgres database."""

    def __init__(
        self,
        url_or_engine: str | Engine,
        *,
        id_factory: Callable[[], str] = new_run_id,
        poison_threshold: int = 2,
        crash_loop_threshold: int = 2,
        worker_ttl: float = 30.0,
        dispatch_depth: int = 2,
        retry_seconds: float = 0.0,
        priority_aging: float = 300.0,
        pool_size: int = DEFAULT_POOL_SIZE,
        transaction_pooler: bool = False,
        direct_url: str = "",
        group_commit: bool = False,
    ) -> None:
        self.db = Database(
            url_or_engine,
            id_factory=id_factory,
            retry_seconds=retry_seconds,
            pool_size=pool_size,
            transaction_pooler=transaction_pooler,
            direct_url=direct_url,
        )
        self.ledger = Ledger(self.db)
        self.settlement = Settlement(self.db, self.ledger)
        self.admission = Admission(
            self.db, self.ledger, worker_ttl=worker_ttl, depth=dispatch_depth, aging=priority_aging
        )
        self.submission = Submission(self.db, self.ledger)
        self.flow = FlowRows(self.db, self.ledger, self.submission.start_roots)
        self.attempts = Attempts(
            self.db,
            self.ledger,
            self.settlement,
            self.admission,
            poison_threshold=poison_threshold,
            group_commit=group_commit,
        )
        self.recovery = Recovery(
            self.db, self.ledger, self.settlement, self.admission, self.attempts,
            crash_loop_threshold=crash_loop_threshold,
        )  # fmt: skip
        self.operator = OperatorActions(self.db, self.ledger, self.settlement, self.admission)
        self.reads = Reads(self.db)
        self.workers = WorkerRegistry(self.db, worker_ttl=worker_ttl)
        self.deliveries = Deliveries(self.db)
        self.progress = ProgressRows(self.db)
        self.tenants = Tenants(self.db)
        self.limits = Limits(self.db)
        self.breakers = Breakers(self.db)
        self.schedule_rows = ScheduleRows(self.db)
        self.triggers = TriggerRows(self.db)
        self.dags = DagRows(self.db)
        self.waits = Waits(self.db, self.admission)
        self.cleanup = Cleanup(self.db)
        self.deadlines = Deadlines(self.db, self.ledger)
        self.children = ChildRows(self.db, self.ledger, self.settlement, self.admission)

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @cached_property
    def signing_key(self) -> bytes:
        """The deployment's key for the fencing headers' signature (``orc_secrets``; made by
        migration 0005, or here on first use by a database created without migrations)."""
        table = s.secrets
        query = sa.select(table.c.value).where(table.c.name == "signing_key")
        with self.engine.connect() as conn:
            value = conn.execute(query).scalar()
        if value is None:
            try:
                with self.engine.begin() as conn:
                    conn.execute(table.insert().values(name="signing_key", value=secrets.token_hex(32)))
            except sa.exc.IntegrityError:
                pass  # another process made it first
            with self.engine.connect() as conn:
                value = conn.execute(query).scalar_one()
        return bytes.fromhex(value)

    def create_schema(self) -> None:
        self.db.create_schema()

    def check_schema(self) -> None:
        self.db.check_schema()

    def dispose(self) -> None:
        """Close this process's connections: the store's pool and the hot path's idle ones."""
        self.db.dispose()
        self.attempts.hot.close()


__all__ = ["Database", "Store", "make_engine", "new_run_id"]
