"""Schedule names per tenant: ``orc_schedules`` is keyed by (tenant, name), its firings by
(tenant, schedule, logical date), and a run's one-per-instant constraint is per tenant
(``uq_orc_runs_schedule_instant`` on tenant, schedule, logical date). Two tenants may each have a
schedule called ``nightly``; neither can take a name before the other.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint("orc_schedules_pkey", "orc_schedules", type_="primary")
    op.create_primary_key("orc_schedules_pkey", "orc_schedules", ["tenant", "name"])
    # a firing is its schedule's tenant's (until now a name was the deployment's: one tenant each)
    op.add_column("orc_schedule_firings", sa.Column("tenant", sa.String(64), nullable=True))
    op.execute("UPDATE orc_schedule_firings f SET tenant = s.tenant FROM orc_schedules s WHERE s.name = f.schedule")
    op.execute("DELETE FROM orc_schedule_firings WHERE tenant IS NULL")  # of no schedule: left by a removal
    op.alter_column("orc_schedule_firings", "tenant", existing_type=sa.String(64), nullable=False)
    op.drop_constraint("orc_schedule_firings_pkey", "orc_schedule_firings", type_="primary")
    op.create_primary_key("orc_schedule_firings_pkey", "orc_schedule_firings", ["tenant", "schedule", "logical_date"])
    op.drop_constraint("uq_orc_runs_schedule_instant", "orc_runs", type_="unique")
    op.create_unique_constraint("uq_orc_runs_schedule_instant", "orc_runs", ["tenant", "schedule", "logical_date"])


def downgrade() -> None:
    # two tenants' schedules of one name cannot both stay: the downgrade refuses then
    op.drop_constraint("uq_orc_runs_schedule_instant", "orc_runs", type_="unique")
    op.create_unique_constraint("uq_orc_runs_schedule_instant", "orc_runs", ["schedule", "logical_date"])
    op.drop_constraint("orc_schedule_firings_pkey", "orc_schedule_firings", type_="primary")
    op.create_primary_key("orc_schedule_firings_pkey", "orc_schedule_firings", ["schedule", "logical_date"])
    op.drop_column("orc_schedule_firings", "tenant")
    op.drop_constraint("orc_schedules_pkey", "orc_schedules", type_="primary")
    op.create_primary_key("orc_schedules_pkey", "orc_schedules", ["name"])
