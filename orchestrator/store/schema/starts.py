"""What starts runs: schedules and their firings, the DAG registry, events (and signals), and the
event triggers with their firings."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from .base import TS, metadata

schedules = sa.Table(
    "orc_schedules",
    metadata,
    #: a schedule fires runs of a DAG at the instants of its cron expression (in its zone, with
    #: its DST policy) or every ``every_seconds`` (``orchestrator schedule add``; orchestrator.schedules);
    #: names are unique per tenant (key: tenant, name)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("cron", sa.String(200), nullable=True),
    sa.Column("every_seconds", sa.Float, nullable=True),
    sa.Column("timezone", sa.String(64), nullable=False),
    sa.Column("dst_gap", sa.String(8), nullable=False),
    sa.Column("dst_fold", sa.String(8), nullable=False),
    sa.Column("catchup", sa.String(8), nullable=False),
    sa.Column("max_catchup", sa.Integer, nullable=False),
    sa.Column("overlap", sa.String(16), nullable=False),
    sa.Column("max_active_runs", sa.Integer, nullable=True),
    #: what it runs: a spec snapshotted at add/apply (with its content hash), or a factory
    #: ``module:function(logical_date, params) -> DAG``
    sa.Column("spec", sa.JSON, nullable=True),
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("factory", sa.String(255), nullable=True),
    #: or a DAG of the registry (``orc_dags``, the schedule's tenant's), at ``registered_version``
    #: or, when that is null, at its latest version when the schedule fires
    sa.Column("registered", sa.String(200), nullable=True),
    sa.Column("registered_version", sa.Integer, nullable=True),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False),
    #: the next instant to look at (UTC; due when the database clock passes it)
    sa.Column("next_at", TS, nullable=False),
    #: the last instant decided (fired or recorded as skipped)
    sa.Column("last_at", TS, nullable=True),
    #: overlap=buffer_one: the instant waiting for the previous run to end
    sa.Column("buffered_at", TS, nullable=True),
    sa.Column("last_run_id", sa.String(32), nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("last_error_at", TS, nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)
sa.Index("ix_orc_schedules_due", schedules.c.paused, schedules.c.next_at)

firings = sa.Table(
    "orc_schedule_firings",
    metadata,
    #: every instant of a schedule that was decided: ``pending`` (a run is being created),
    #: ``fired`` (``run_id``), ``skipped`` (``reason``: missed, overlap, ...) or ``failed``;
    #: of the schedule (``tenant``, ``schedule``)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("schedule", sa.String(200), primary_key=True),
    sa.Column("logical_date", TS, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    #: scheduled, catchup, buffered, backfill or manual
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("at", TS, nullable=False),
    #: a registered DAG's schedule: the version the firing ran
    sa.Column("dag_version", sa.Integer, nullable=True),
)

dags = sa.Table(
    "orc_dags",
    metadata,
    #: the DAG registry (``orchestrator dag register``, ``Orchestrator.register``): a DAG's name
    #: per tenant, its newest version, and whether schedules (and events) may start runs of it
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("latest_version", sa.Integer, nullable=False),
    #: ``orchestrator dag pause``: schedules and events start no run (a submit by hand does)
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("paused_at", TS, nullable=True),
    sa.Column("paused_by", sa.String(255), nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

dag_versions = sa.Table(
    "orc_dag_versions",
    metadata,
    #: each version of a registered DAG: its definition (the spec without its tenant) and the
    #: SHA-256 of it; a new version only when the definition differs from the latest
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("registered_at", TS, nullable=False),
    sa.Column("registered_by", sa.String(255), nullable=True),
    sa.ForeignKeyConstraint(
        ["tenant", "name"], ["orc_dags.tenant", "orc_dags.name"], name="fk_orc_dag_versions_dag", ondelete="CASCADE"
    ),
)
#: "which version has this content" (a submit of a spec that is registered; register's check)
sa.Index("ix_orc_dag_versions_hash", dag_versions.c.tenant, dag_versions.c.name, dag_versions.c.content_hash)

emitted = sa.Table(
    "orc_events",
    metadata,
    #: an event (``orchestrator.emit``, ``orchestrator emit``, ``POST /api/events``) or a signal
    #: to one run (``run.signal``: ``run_id`` set): matched against the waits in the transaction
    #: that writes it, kept for the lookback of waits that begin after it and for de-duplication
    #: by ``event_id`` per tenant
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("event_id", sa.String(200), nullable=False),
    sa.Column("payload", postgresql.JSONB, nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("emitted_at", TS, nullable=False),
    sa.Column("by", sa.String(255), nullable=True),
    #: how many waiting tasks it woke when it was written
    sa.Column("woke", sa.Integer, nullable=False, server_default="0"),
    sa.UniqueConstraint("tenant", "event_id", name="uq_orc_events_event_id"),
)
#: a wait that begins looks back for its event (tenant, key, newest first)
sa.Index("ix_orc_events_key", emitted.c.tenant, emitted.c.key, emitted.c.emitted_at)
#: pruning by age
sa.Index("ix_orc_events_emitted", emitted.c.emitted_at)

triggers = sa.Table(
    "orc_triggers",
    metadata,
    #: an event trigger (``orchestrator on add NAME --event KEY``): each event of ``event_key``
    #: (of its tenant) whose payload contains ``match`` starts one run of what it names (a spec
    #: snapshot, a factory or a registered DAG, as a schedule does), the payload laid over its
    #: params; at most ``max_active_runs`` running at once (the others wait their turn)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("event_key", sa.String(200), nullable=False),
    sa.Column("match", postgresql.JSONB, nullable=True),
    sa.Column("spec", sa.JSON, nullable=True),
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("factory", sa.String(255), nullable=True),
    sa.Column("registered", sa.String(200), nullable=True),
    sa.Column("registered_version", sa.Integer, nullable=True),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("max_active_runs", sa.Integer, nullable=True),
    #: ``[most events, window seconds]``: events gathered into one run (``events`` param), or null
    sa.Column("batch", sa.JSON, nullable=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("last_error_at", TS, nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)
sa.Index("ix_orc_triggers_event", triggers.c.tenant, triggers.c.event_key)

trigger_firings = sa.Table(
    "orc_trigger_firings",
    metadata,
    #: one row per (trigger, event): written with the event (``pending``), then ``fired`` with
    #: its run, ``waiting`` (the trigger is at max_active_runs: it runs when one ends),
    #: ``skipped`` (paused) or ``failed``; whoever finds it pending finishes it (the emitter,
    #: any beat, any serve), the run's idempotency key making it one run
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("trigger", sa.String(200), primary_key=True),
    sa.Column("event", sa.BigInteger, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("dag_version", sa.Integer, nullable=True),
    sa.Column("at", TS, nullable=False),
)
sa.Index(
    "ix_orc_trigger_firings_open",
    trigger_firings.c.state,
    trigger_firings.c.at,
    postgresql_where=sa.text("state IN ('pending', 'waiting')"),
)
