"""Usage rolled up per account, key, model and day (and per day and model for the platform), written
by the ledger in the same transaction as its rows and backfilled here from the rows already there; the
plans' monthly prices as the platform sells them (Pro $80, Premium $350).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Monthly prices in cents: (as sold now, as 0001 seeded them).
MONTHLY_CENTS = {"pro": (8000, 2000), "premium": (35000, 9900)}



def _sums() -> list[sa.Column]:
    return [sa.Column(name, sa.BigInteger, nullable=False, server_default="0")
            for name in ("requests", "billable_requests", "price_micros")]


def _day_sql(dialect: str) -> str:
    """A ledger row's day: its quota day, else (a row written without a charge) its UTC date."""
    if dialect == "postgresql":
        return "COALESCE(quota_day, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD'))"
    return "COALESCE(quota_day, substr(created_at, 1, 10))"  # SQLite stores UTC as 'YYYY-MM-DD HH:MM:SS'


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("api_key_id", sa.Integer, sa.ForeignKey("api_keys.id"), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        *_sums(),
    )
    op.create_table(
        "usage_platform_daily",
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        *_sums(),
    )
    day = _day_sql(op.get_bind().dialect.name)
    rows = (f"SELECT account_id, {day} AS day, api_key_id, model, billable, price_micros FROM requests")
    op.execute(
        "INSERT INTO usage_daily (account_id, day, api_key_id, model, requests, billable_requests, price_micros) "
        "SELECT account_id, day, api_key_id, model, count(*), "
        "sum(CASE WHEN billable THEN 1 ELSE 0 END), sum(CASE WHEN billable THEN price_micros ELSE 0 END) "
        f"FROM ({rows}) AS r GROUP BY account_id, day, api_key_id, model")
    op.execute(
        "INSERT INTO usage_platform_daily (day, model, requests, billable_requests, price_micros) "
        "SELECT day, model, sum(requests), sum(billable_requests), sum(price_micros) "
        "FROM usage_daily GROUP BY day, model")
    plans = sa.table("plans", sa.column("name", sa.String), sa.column("monthly_price_cents", sa.Integer))
    for name, (cents, _) in MONTHLY_CENTS.items():
        op.execute(plans.update().where(plans.c.name == name).values(monthly_price_cents=cents))


def downgrade() -> None:
    plans = sa.table("plans", sa.column("name", sa.String), sa.column("monthly_price_cents", sa.Integer))
    for name, (_, cents) in MONTHLY_CENTS.items():
        op.execute(plans.update().where(plans.c.name == name).values(monthly_price_cents=cents))
    op.drop_table("usage_platform_daily")
    op.drop_table("usage_daily")
