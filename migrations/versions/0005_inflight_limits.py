"""Fair shares: a plan's cap on jobs in flight, an account's override of it, and a key's own cap.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Requests an account may have queued or running at once (None: no cap). One script on a free key
# can no longer fill a lane that every other account on it waits behind.
MAX_INFLIGHT = {"free": 4, "trial": 16, "pro": 16, "premium": 64, "enterprise": None}


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("max_inflight", sa.Integer))
    plans = sa.table("plans", sa.column("name", sa.String), sa.column("max_inflight", sa.Integer))
    for name, cap in MAX_INFLIGHT.items():
        op.execute(plans.update().where(plans.c.name == name).values(max_inflight=cap))
    with op.batch_alter_table("accounts") as batch:
        # None: the plan's cap; a number replaces it, above or below (an enterprise contract's).
        batch.add_column(sa.Column("max_inflight_override", sa.Integer))
    with op.batch_alter_table("api_keys") as batch:
        # None: only the account's cap; a number caps this key too (the lower of the two binds).
        batch.add_column(sa.Column("max_inflight", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("max_inflight")
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("max_inflight_override")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("max_inflight")
