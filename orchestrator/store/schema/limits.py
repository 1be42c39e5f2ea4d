"""What holds tasks back: tenants' shares and limits, pools, rate limits, per-DAG limits, and the
circuit breakers per resource with their counts, probes and ledger."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from .base import TS, metadata

tenants = sa.Table(
    "orc_tenants",
    metadata,
    #: a tenant's weight in the fair share of admission (default 1 for a tenant with no row)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("weight", sa.Float, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    #: written by admission up to migration 0036 (round robin); since then the turns are kept per
    #: group of queues in ``orc_admission_shares`` and this column is no longer written or read
    sa.Column("last_admitted_at", TS, nullable=True),
    #: most tasks of this tenant QUEUED or RUNNING at once, across every queue (null: no limit)
    sa.Column("max_running", sa.Integer, nullable=True),
    #: the tenant's tasks go to its own queues (orchestrator.tenant.<name>.<priority>), served by
    #: workers started with `orchestrator worker --tenant <name>`
    sa.Column("dedicated", sa.Boolean, nullable=False, server_default=sa.false()),
)

#: admission's memory of which tenant it served, per group of queues (``orc_admit_from_v2``,
#: migration 0036): ``recent`` about how many of the group's last window of contested picks went
#: to the tenant (decayed per pick), ``turn`` the group's pick count at its last one (round robin)
admission_shares = sa.Table(
    "orc_admission_shares",
    metadata,
    sa.Column("queues", sa.Text, primary_key=True),
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("finish", sa.Float, nullable=False),
    sa.Column("turn", sa.BigInteger, nullable=False),
)

pools = sa.Table(
    "orc_pools",
    metadata,
    #: a named pool of slots (``orchestrator pool set NAME --slots N``): the tasks that name it hold
    #: ``pool_slots`` each while QUEUED or RUNNING, counted from the task rows at admission
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("slots", sa.Integer, nullable=False),
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("updated_at", TS, nullable=False),
)

rate_limits = sa.Table(
    "orc_rate_limits",
    metadata,
    #: a token bucket for the whole deployment (``orchestrator limit set KEY --rate 10/s``): each
    #: admission of a task naming it takes a token; ``rate`` tokens per second refill it up to ``burst``
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("rate", sa.Float, nullable=False),
    sa.Column("burst", sa.Integer, nullable=False),
    #: tokens left at ``refilled_at`` (the refill since then is computed when a token is taken)
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("refilled_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

dag_limits = sa.Table(
    "orc_dag_limits",
    metadata,
    #: most tasks QUEUED or RUNNING at once across every run of one tenant's DAG
    #: (``orchestrator --tenant T dag set NAME --max-running N``)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("dag_name", sa.String(200), primary_key=True),
    sa.Column("max_running", sa.Integer, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

breakers = sa.Table(
    "orc_breakers",
    metadata,
    #: a circuit breaker per resource (``orchestrator breaker set NAME``): ``mode`` on (counts and
    #: holds), metrics (counts, never holds) or disabled; ``state`` closed, open or half_open
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    #: opened by an operator: stays open until ``breaker close``
    sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    #: the trip rule over the last ``window_seconds``: calls >= min_calls, failures >= min_failures
    #: and failures / calls >= failure_rate
    sa.Column("window_seconds", sa.Float, nullable=False),
    sa.Column("min_calls", sa.Integer, nullable=False),
    sa.Column("min_failures", sa.Integer, nullable=False),
    sa.Column("failure_rate", sa.Float, nullable=False),
    #: exception class names counted as the resource's failures besides time-outs and connection errors
    sa.Column("failure_on", postgresql.ARRAY(sa.Text), nullable=True),
    #: how long it stays open: open_min at the first trip, doubled per consecutive re-open up to open_max
    sa.Column("open_min", sa.Float, nullable=False),
    sa.Column("open_max", sa.Float, nullable=False),
    #: half-open: how many probe permits, and each probe's lease
    sa.Column("probes", sa.Integer, nullable=False),
    sa.Column("probe_lease", sa.Float, nullable=False),
    #: after closing, waves of 1, 2, 4 ... tasks up to ramp_max (1: no ramp)
    sa.Column("ramp_max", sa.Integer, nullable=False),
    sa.Column("open_for", sa.Float, nullable=True),
    sa.Column("open_until", TS, nullable=True),
    sa.Column("reopens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("probes_left", sa.Integer, nullable=False, server_default="0"),
    #: the ramp's wave in progress (null: not ramping), tasks admitted and succeeded in it
    sa.Column("wave", sa.Integer, nullable=True),
    sa.Column("wave_admitted", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wave_done", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wave_at", TS, nullable=True),
    sa.Column("changed_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

breaker_counts = sa.Table(
    "orc_breaker_counts",
    metadata,
    #: a breaker's calls and failures per second (its sliding window sums the last window_seconds)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("second", TS, primary_key=True),
    sa.Column("calls", sa.Integer, nullable=False),
    sa.Column("failures", sa.Integer, nullable=False),
)

breaker_probes = sa.Table(
    "orc_breaker_probes",
    metadata,
    #: a half-open breaker's probe permit handed to a task attempt, until lease_until (a probe
    #: that outlives it counts as a failure)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("lease_until", TS, nullable=False),
)

breaker_events = sa.Table(
    "orc_breaker_events",
    metadata,
    #: every state change of a breaker and every operator action on it, with who acted; alerted_at:
    #: when the reconciler posted its alert and counted its metric
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(64), nullable=False),
    sa.Column("from_state", sa.String(16), nullable=True),
    sa.Column("to_state", sa.String(16), nullable=False),
    sa.Column("actor", sa.String(32), nullable=False),
    sa.Column("by", sa.String(255), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("at", TS, nullable=False),
    sa.Column("alerted_at", TS, nullable=True),
)
sa.Index("ix_orc_breaker_events_name", breaker_events.c.name, breaker_events.c.id)
sa.Index("ix_orc_breaker_events_unalerted", breaker_events.c.id, postgresql_where=sa.text("alerted_at IS NULL"))
