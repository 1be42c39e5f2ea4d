"""The control plane sharded with epochs (issue 35): the reconciler's shards.

Three new tables and one nullable column, no row rewritten and no server function changed:
``orc_shard_config`` (one row: K, the deployment's number of logical shards, written by the first
reconciler started with ``ORCHESTRATOR_RECONCILER_SHARDS`` and fixed afterwards), ``orc_shards``
(per shard: owner, epoch, lease, claimed/renewed times), ``orc_reconcilers`` (the live instances'
heartbeats) and ``orc_runs.shard`` (``hash(id) mod K``, set at submit once K is stored; null on
older runs, whose shard the same SQL expression computes where it is read). A worker of the
previous release submits runs with a null shard, which is served the same way.

Revision ID: 0035
Revises: 0034
"""

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("shard", sa.Integer, nullable=True))
    op.create_table(
        "orc_shard_config",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("shards", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("id = 1", name="ck_orc_shard_config_one_row"),
        sa.CheckConstraint("shards BETWEEN 1 AND 4096", name="ck_orc_shard_config_shards"),
    )
    op.create_table(
        "orc_shards",
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("claimed_at", TS, nullable=True),
        sa.Column("renewed_at", TS, nullable=True),
        sa.Column("previous_owner", sa.String(255), nullable=True),
    )
    op.create_table(
        "orc_reconcilers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("orc_reconcilers")
    op.drop_table("orc_shards")
    op.drop_table("orc_shard_config")
    op.drop_column("orc_runs", "shard")
