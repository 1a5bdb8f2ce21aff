"""Usage rows name their Stripe meter: live requests go to the requests meter (every row so far), Batch API
lines to a batch meter of their own, priced per plan at the batch discount.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_outbox") as batch:
        batch.add_column(sa.Column("meter", sa.String(32), nullable=False, server_default="requests"))


def downgrade() -> None:
    # In place, as 0013's and 0015's downgrades: batch mode would copy the table.
    op.drop_column("usage_outbox", "meter")
