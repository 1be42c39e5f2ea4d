"""Idempotency keys outlive db clean (placeholder).

Revision ID: 0022
Revises: 0021
"""

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
