"""Stored responses (POST /v1/responses with ``store``): each account's finished responses and the
input items they answered, so any gateway process can read one back or continue its conversation
(``previous_response_id``).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("input_items", sa.Text(), nullable=False),
    )
    op.create_index("ix_stored_responses_account_id", "stored_responses", ["account_id"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_account_id", table_name="stored_responses")
    op.drop_table("stored_responses")
