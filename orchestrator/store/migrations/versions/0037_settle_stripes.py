"""The fan-in's settlement off one hot row (issue 35): placeholder revision reserved while the work is under way; changes nothing yet.

Revision ID: 0037
Revises: 0036
"""

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
