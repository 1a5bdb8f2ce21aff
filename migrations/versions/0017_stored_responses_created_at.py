"""An index on stored responses' creation time: every gateway process deletes those past the retention
(``responses_retention_days``) each files sweep, by ``created_at``, which without it scans the table.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_stored_responses_created_at", "stored_responses", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_created_at", table_name="stored_responses")
