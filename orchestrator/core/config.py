"""Settings from ``ORCHESTRATOR_*`` environment variables.

With none set, the embedded default applies: an embedded PostgreSQL (``orchestrator.store.embedded``)
and kombu's filesystem transport, both under ``ORCHESTRATOR_DATA_DIR`` (``./.orchestrator``):
no server to install, nothing written outside that directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .dag import SizeLimits
from .errors import ConfigurationError
from .workers import code_version_problem

# the embedded default's URL (the server itself: orchestrator.store.embedded)
SCHEME = "embedded://"
#: the database the orchestrator uses on the embedded server
DATABASE = "orchestrator"


def url_for(data_dir: str | os.PathLike[str]) -> str:
    """The ``embedded://`` URL of the server kept under ``data_dir`` (its ``pg`` folder)."""
    return SCHEME + str(Path(data_dir).absolute() / "pg")


def data_dir_of(url: str) -> Path:
    """The server's data directory named by an ``embedded://`` URL."""
    path = url[len(SCHEME) :] if url.startswith(SCHEME) else ""
    if not path.startswith("/"):
        raise ConfigurationError(f"{url!r}: an embedded database URL is embedded:///absolute/path")
    return Path(path)


PREFIX = "ORCHESTRATOR_"


@dataclass(frozen=True)
class Settings:
    data_dir: str = ".orchestrator"
    database_url: str = ""
    broker_url: str = ""
    #: comma-separated modules that define the tasks DAG nodes may name
    task_modules: tuple[str, ...] = ("tasks.probes", "tasks.etl", "tasks.dynamic", "tasks.canvas")
    #: the code version this worker advertises (a build id: 1-64 letters, digits or . _ + -);
    #: empty: a hash of the source files of its task modules. A worker of version V also
    #: consumes ``QUEUE@V`` for each queue it consumes, where the tasks of a run submitted with
    #: ``code_version=V`` go (``orchestrator.core.workers``)
    code_version: str = ""
    dedicated_tenants: tuple[str, ...] = ()
    #: the tenant this process acts as: reads, operator actions and idempotency lookups see
    #: that tenant's runs only, and it submits as that tenant; empty: every tenant (the
    #: operator of the deployment)
    tenant: str = ""
    #: seconds a claimed task may go without a heartbeat before it counts as lost
    lease_seconds: float = 30.0
    #: seconds a direct message's body runs before its worker claims it (a body that finishes
    #: sooner commits its claim and its success in one transaction); 0 (the default): claim
    #: before every body
    claim_delay: float = 0.0
    #: seconds between reconciler passes (due retries -> READY, lost work, READY -> dispatch)
    tick_seconds: float = 1.0
    #: run the reconciler service in every worker's main process (one on duty at a time)
    worker_reconciler: bool = True
    #: seconds a paused process may hold the reconciler duty before the database frees it
    reconciler_stall_seconds: float = 10.0
    #: the sharded control plane (issue 35): 0 (the default) keeps one reconciler on duty for the
    #: whole deployment (a session advisory lock); K > 0 splits the runs over K logical shards
    #: (``hash(run id) mod K``) that the reconciler instances claim by compare-and-set, each
    #: renewing a lease on its shards and taking ceil(K / live instances); every write one makes
    #: for a run carries the epoch it read for the run's shard and is refused once it moved. K is
    #: stored by the first sharded reconciler and fixed for the deployment's life (a later value
    #: that differs is ignored with a warning)
    reconciler_shards: int = 0
    #: seconds a shard's owner holds it without renewing (every pass renews): a killed owner's
    #: shards are taken over this long after its last pass at most
    reconciler_shard_lease: float = 10.0
    #: most tasks QUEUED or RUNNING at once; the rest waits in the database as READY
    dispatch_window: int = 2000
    #: a READY task that waited this many seconds is admitted as if one priority class higher
    #: (twice as long: two classes), so a low backlog is never starved by a stream of high
    #: work; 0 turns aging off
    priority_aging_seconds: float = 300.0
    #: messages in flight per live worker slot (the next one waits in the broker, not in a
    #: completion's transaction); 1 admits exactly the free slots
    dispatch_depth: int = 2
    #: Redis visibility timeout; must exceed the longest hard time limit
    visibility_timeout: float = 3600.0
    #: hard time limit of tasks without their own; also the most a node may ask for
    max_time_limit: float = 1800.0
    #: seconds a QUEUED task may stay unclaimed before the reconciler re-publishes it
    dispatch_timeout: float = 60.0
    #: seconds without a registry heartbeat after which a worker's capacity no longer counts
    worker_ttl: float = 30.0
    #: the watchdog: a QUEUED task whose message was re-published this many times without a
    #: claim is flagged (needs_attention, a ``task_stuck`` alert, ``orchestrator_stuck_tasks``);
    #: 0: never
    stuck_republishes: int = 3
    #: the watchdog: a RUNNING run with no transition for this many seconds while no task of it
    #: is RUNNING, WAITING, RETRYING or DEAD_LETTER (nothing it waits on is named) is flagged;
    #: 0: never
    stuck_run_seconds: float = 3600.0
    #: the same failure fingerprint on this many consecutive attempts -> DEAD_LETTER (0: off)
    poison_threshold: int = 2
    #: this many consecutive lost leases without an exception -> DEAD_LETTER as a crash loop
    crash_loop_threshold: int = 2
    #: a broker message redelivered this many times (its pool process died each time) is
    #: parked in the ``orchestrator.parked`` queue with the evidence instead of run again
    max_redeliveries: int = 3
    #: Celery task events from the workers (Flower turns them on by itself when it starts)
    task_events: bool = False
    #: URL that receives a JSON POST for every task parked in DEAD_LETTER
    alert_webhook: str = ""
    #: probe tasks write one orc_probe_effects row per execution (fault tests, soak)
    record_probe_effects: bool = False
    #: register the probe tasks that kill (``tasks.probes.crash``) or block (``hang``) their
    #: pool process: tests and the chaos soak only
    hazard_probes: bool = False
    #: seconds between the scheduler's passes at most: a schedule added, changed or paused
    #: through the CLI or API is seen by a running beat within this time
    beat_interval: float = 5.0
    #: seconds an instant may be late and still fire under ``--catchup none``
    schedule_grace_seconds: float = 60.0
    #: the shortest interval a schedule may fire at: an ``every`` below it, or a cron expression
    #: whose instants come closer, is refused (0: no minimum)
    schedule_min_interval_seconds: float = 60.0
    #: comma-separated modules (a package covers its submodules) whose ``@dag_factory`` functions
    #: a schedule may run (``--dag module:function``); nothing else is imported or called
    dag_factory_modules: tuple[str, ...] = ("tasks.dags",)
    #: ``orchestrator serve``'s credentials, comma-separated: ``user:password`` (HTTP basic) or
    #: a token of 16+ characters (``Authorization: Bearer``, ``/login?token=``, the login form),
    #: each optionally ``=TENANT`` (sees and acts on that tenant only) or ``=*`` (every tenant);
    #: empty: on a loopback bind ``serve`` makes a token at start and prints its login URL, on
    #: any other bind it refuses to start (checked in :mod:`orchestrator.web`)
    ui_auth: str = field(default="", repr=False)
    #: ``serve`` sits behind a proxy that terminates TLS: its cookies (the session's, the XSRF
    #: token's) are ``Secure`` (a request that came over TLS gets them ``Secure`` anyway);
    #: ``orchestrator serve --behind-tls-proxy`` says the same
    ui_behind_tls_proxy: bool = False
    #: seconds an event (``orchestrator emit``) is kept: for the lookback of waits that begin
    #: after it and for de-duplication by event id; the reconciler deletes older ones
    event_retention_seconds: float = 7 * 86400.0
    #: the most bytes of JSON an event's payload (or a signal's, an approval's comment) may hold
    max_event_bytes: int = 64 * 1024
    #: seconds any statement of an emit (or a signal) may run: the matching of its payload
    #: against the waits and event triggers of its key, their wakes, the admission of what they
    #: made READY; past it the emit is rolled back (``EmitTimeout``, nothing written); 0: no bound
    emit_timeout_seconds: float = 30.0
    #: Postgres connections one process keeps for its store, shared by its threads (as many
    #: again at a peak; a thread waits for a free one beyond that), and for the hot path's claims
    #: and outcomes; opened as needed (docs/operations.md counts a deployment's connections)
    db_pool_size: int = 4
    #: group commit: the claims and outcomes that one process's threads make while one of
    #: theirs is in flight go together in one transaction (one round trip, one commit); a
    #: process with one body at a time (prefork) is unchanged. On by default since issue 35 (six
    #: 1,000-fault chaos soaks, three of them on threads pools with it: 0 lost, 0 twice, 0 stuck)
    group_commit: bool = True
    #: the database URL goes through a pooler in transaction mode (PgBouncer): no server-side
    #: prepared statements, no session state on its connections; the reconciler's duty (a
    #: session advisory lock) then needs ``db_direct_url``
    db_transaction_pooler: bool = False
    #: a URL straight to Postgres (not through a pooler) for the reconciler's duty lock, which
    #: it holds on a connection of its own; empty: the database URL
    db_direct_url: str = field(default="", repr=False)
    max_nodes: int = 100_000
    max_node_bytes: int = 64 * 1024
    max_params_bytes: int = 256 * 1024
    max_result_bytes: int = 1024 * 1024
    #: most bytes of JSON in one progress report (``update_state``'s ``meta``): a bigger one is
    #: refused with a ValidationError raised in the body
    max_progress_bytes: int = 8 * 1024
    #: least seconds between two progress writes of one attempt: reports in between keep only
    #: the latest, written when the interval is up or before the attempt's outcome
    progress_interval: float = 0.5
    #: the most tasks of one run QUEUED or RUNNING at once for a DAG that sets no
    #: ``max_active_tasks`` (Airflow's per-DAG default is 16); 0: no cap. Without one, the runs of a
    #: tenant still share its admission by their tasks in flight
    run_max_active_tasks: int = 0
    #: a fan-in with at least 4 x this many plain parents counts their arrivals over this many
    #: rows (``orc_stripes``) instead of its own row and the run's, each written once per stripe
    #: (issue 35; ``store/stripes.py``); 0: every arrival counted into the join's row at once
    fanin_stripes: int = 16

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith(SCHEME)

    @property
    def limits(self) -> SizeLimits:
        return SizeLimits(self.max_nodes, self.max_node_bytes, self.max_params_bytes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read settings from ``env`` (default ``os.environ``); raise :class:`ConfigurationError`."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _convert(f.name, raw, getattr(cls, f.name, None))
        values.update(overrides)
        settings = cls(**values)
        if settings.run_max_active_tasks < 0:
            raise ConfigurationError(
                f"{PREFIX}RUN_MAX_ACTIVE_TASKS={settings.run_max_active_tasks} must be 0 (no cap) or more"
            )
        if not 0 <= settings.fanin_stripes <= 1024:
            raise ConfigurationError(
                f"{PREFIX}FANIN_STRIPES={settings.fanin_stripes} must be 0 (no stripes) or a number of stripes"
                " from 1 to 1024"
            )
        if not 0 <= settings.reconciler_shards <= 4096:
            raise ConfigurationError(
                f"{PREFIX}RECONCILER_SHARDS={settings.reconciler_shards} must be 0 (one reconciler on duty)"
                " or a number of shards from 1 to 4096"
            )
        if settings.reconciler_shard_lease <= 0:
            raise ConfigurationError(
                f"{PREFIX}RECONCILER_SHARD_LEASE={settings.reconciler_shard_lease} must be more than 0 seconds"
            )
        if settings.db_pool_size < 1:
            raise ConfigurationError(f"{PREFIX}DB_POOL_SIZE={settings.db_pool_size} must be at least 1")
        if settings.code_version and (problem := code_version_problem(settings.code_version)):
            raise ConfigurationError(f"{PREFIX}CODE_VERSION {problem}")
        return settings.with_defaults()

    def with_defaults(self) -> Settings:
        data = Path(self.data_dir).absolute()
        db = self.database_url or url_for(data)
        broker = self.broker_url or "filesystem://"
        return _replace(self, database_url=db, broker_url=broker, data_dir=str(data))

    def broker_transport_options(self) -> dict[str, Any]:
        if self.broker_url.startswith("filesystem"):
            folder = Path(self.data_dir) / "broker"
            return {
                "data_folder_in": str(folder),
                "data_folder_out": str(folder),
                "processed_folder": str(Path(self.data_dir) / "processed"),
                # the exchange tables (kombu's default: ./control in the working directory)
                "control_folder": str(Path(self.data_dir) / "control"),
                "store_processed": False,
                "polling_interval": 0.05,
            }
        if self.broker_url.startswith(("redis", "rediss", "sentinel")):
            return {"visibility_timeout": self.visibility_timeout}
        return {}


def _replace(s: Settings, **changes: Any) -> Settings:
    from dataclasses import replace

    return replace(s, **changes)


def _convert(name: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, tuple):
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if isinstance(default, bool):
            return raw.lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return raw
    except ValueError:
        raise ConfigurationError(f"{PREFIX}{name.upper()}={raw!r} is not a valid {type(default).__name__}") from None
