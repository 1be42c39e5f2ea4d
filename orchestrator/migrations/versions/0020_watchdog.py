"""The watchdog: tasks no live worker has registered are held, re-publishes are counted (placeholder).

Revision ID: 0020
Revises: 0019
"""

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
