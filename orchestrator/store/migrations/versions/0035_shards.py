"""The control plane sharded with epochs (issue 35): placeholder revision reserved while the work is under way; changes nothing yet.

Revision ID: 0035
Revises: 0034
"""

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
