"""A cleared or re-expanded task's messages never reuse a revoked Celery task id (placeholder).

Revision ID: 0019
Revises: 0018
"""

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
