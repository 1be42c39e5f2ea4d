"""The DAG registry: ``orc_dags`` (a DAG's name per tenant, its latest version, paused or not) and
``orc_dag_versions`` (each version's definition and content hash); a run's ``dag_version``, a
schedule's ``registered`` DAG (and ``registered_version``, null: the latest) and a firing's
``dag_version``. Tables and columns only: registering is not a task transition.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "orc_dags",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("latest_version", sa.Integer, nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("paused_at", TS, nullable=True),
        sa.Column("paused_by", sa.String(255), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "orc_dag_versions",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("registered_at", TS, nullable=False),
        sa.Column("registered_by", sa.String(255), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant", "name"], ["orc_dags.tenant", "orc_dags.name"], name="fk_orc_dag_versions_dag",
            ondelete="CASCADE",
        ),
    )  # fmt: skip
    op.create_index("ix_orc_dag_versions_hash", "orc_dag_versions", ["tenant", "name", "content_hash"])
    op.add_column("orc_runs", sa.Column("dag_version", sa.Integer, nullable=True))
    op.create_index("ix_orc_runs_dag_version", "orc_runs", ["dag_name", "dag_version", "created_at"])
    op.add_column("orc_schedules", sa.Column("registered", sa.String(200), nullable=True))
    op.add_column("orc_schedules", sa.Column("registered_version", sa.Integer, nullable=True))
    op.add_column("orc_schedule_firings", sa.Column("dag_version", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("orc_schedule_firings", "dag_version")
    op.drop_column("orc_schedules", "registered_version")
    op.drop_column("orc_schedules", "registered")
    op.drop_index("ix_orc_runs_dag_version", table_name="orc_runs")
    op.drop_column("orc_runs", "dag_version")
    op.drop_index("ix_orc_dag_versions_hash", table_name="orc_dag_versions")
    op.drop_table("orc_dag_versions")
    op.drop_table("orc_dags")
