"""Tags on runs (issue 34): ``submit(..., tags={"customer": "42", "region": "eu"})``.

``orc_runs.tags`` (new): the run's tags, a JSON object of text values (``jsonb``, not null,
default ``'{}'``: every run an earlier release wrote, and every run an earlier release's
``submit`` writes during a rolling upgrade, has none). Adding a column with a constant default
rewrites no row (PostgreSQL 11+). ``ix_orc_runs_tags`` (new): a GIN index with
``jsonb_path_ops`` over it, for the containment filter (``tags @> '{"customer": "42"}'``) of the
runs list and of bulk actions. No server function changed: tags are written by the submit's
INSERT and read by the runs list, nothing on the hot path touches them, so a worker of the
previous release is served as before.

Revision ID: 0030
Revises: 0029
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "orc_runs",
        sa.Column("tags", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    op.create_index(
        "ix_orc_runs_tags", "orc_runs", ["tags"], postgresql_using="gin", postgresql_ops={"tags": "jsonb_path_ops"}
    )


def downgrade() -> None:
    # the runs' tags are lost with the column (a downgrade keeps the runs themselves)
    op.drop_index("ix_orc_runs_tags", table_name="orc_runs")
    op.drop_column("orc_runs", "tags")
