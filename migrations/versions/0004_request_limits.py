"""Bounded work per request and per-key limits: a plan's prompt-token cap; a key's models and daily cap.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Input tokens a plan lets one request send (None: the model's context is the only bound). A free
# request no longer buys a 128k-token prefill on a long-context model.
PROMPT_TOKENS = {"free": 4096, "pro": 32768, "premium": 131072, "trial": 32768, "enterprise": None}


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("max_prompt_tokens", sa.Integer))
    plans = sa.table("plans", sa.column("name", sa.String), sa.column("max_prompt_tokens", sa.Integer))
    for name, cap in PROMPT_TOKENS.items():
        op.execute(plans.update().where(plans.c.name == name).values(max_prompt_tokens=cap))
    with op.batch_alter_table("api_keys") as batch:
        # None: whatever the account's plan allows; a list narrows it, never widens it.
        batch.add_column(sa.Column("allowed_models", sa.JSON))
        # None: the account's daily limit is the key's; a number caps this key below it.
        batch.add_column(sa.Column("daily_limit", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("daily_limit")
        batch.drop_column("allowed_models")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("max_prompt_tokens")
