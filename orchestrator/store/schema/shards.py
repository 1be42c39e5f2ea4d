"""The reconciler's shards (issue 35): the number of logical shards, fixed for the deployment's
life once the first sharded reconciler stored it; each shard's owner, epoch and lease; the live
reconciler instances (their heartbeats), from which each one computes its fair share of shards.
A run's shard is ``hash(run id) mod K`` (``store.shards.shard_of``), stored on the run at submit
(``orc_runs.shard``; null on runs older than the first sharded reconciler, computed by the same
expression where read)."""

from __future__ import annotations

import sqlalchemy as sa

from .base import TS, metadata

#: one row (``id`` 1): how many logical shards the deployment has (``ORCHESTRATOR_RECONCILER_SHARDS``
#: when the first sharded reconciler started); never changed afterwards, a run's shard depends on it
shard_config = sa.Table(
    "orc_shard_config",
    metadata,
    sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
    sa.Column("shards", sa.Integer, nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
    sa.CheckConstraint("id = 1", name="ck_orc_shard_config_one_row"),
    sa.CheckConstraint("shards BETWEEN 1 AND 4096", name="ck_orc_shard_config_shards"),
)

#: one row per shard: who owns it, the epoch (bumped by every claim: a write of the reconciler
#: carries the epoch it read and is refused once it moved), until when the owner's lease runs
shards = sa.Table(
    "orc_shards",
    metadata,
    sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
    #: the reconciler instance that owns it (``orc_reconcilers.name``); null: free
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("lease_expires_at", TS, nullable=True),
    #: when its owner claimed it and last renewed it (the lag ``orchestrator shards`` shows)
    sa.Column("claimed_at", TS, nullable=True),
    sa.Column("renewed_at", TS, nullable=True),
    #: the owner before the last claim (who was deposed or gave it back)
    sa.Column("previous_owner", sa.String(255), nullable=True),
)

#: the live reconciler instances of the sharded mode: each renews its row every pass; an
#: instance counts while ``expires_at`` is ahead (each targets ceil(K / live instances) shards)
reconcilers = sa.Table(
    "orc_reconcilers",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("seen_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
)
