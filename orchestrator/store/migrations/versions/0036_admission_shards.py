"""Admission without a deployment-wide lock (issue 35): placeholder revision reserved while the work is under way; changes nothing yet.

Revision ID: 0036
Revises: 0035
"""

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
