"""Plans as the platform sells them by default: flat monthly prices, no per-request price. 0001 seeded
per-request prices (Pro 2,000, Premium 1,500, Enterprise 1,000 micro-USD), which Checkout can only sell
with a metered Stripe price configured (FLATFARE_STRIPE_METERED_PRICES), so a stock deployment could not
sell Pro or Premium. A metered price stays an operator option: set one on a plan through the admin API.
Only a plan still at its seeded price changes, so an operator's own price survives both ways.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Per-request prices in micro-USD as 0001 seeded them; free and trial were already 0.
SEEDED_MICROS = {"pro": 2000, "premium": 1500, "enterprise": 1000}

_plans = sa.table("plans", sa.column("name", sa.String), sa.column("price_per_request_micros", sa.BigInteger))


def upgrade() -> None:
    for name, micros in SEEDED_MICROS.items():
        op.execute(_plans.update()
                   .where(_plans.c.name == name, _plans.c.price_per_request_micros == micros)
                   .values(price_per_request_micros=0))


def downgrade() -> None:
    for name, micros in SEEDED_MICROS.items():
        op.execute(_plans.update()
                   .where(_plans.c.name == name, _plans.c.price_per_request_micros == 0)
                   .values(price_per_request_micros=micros))
