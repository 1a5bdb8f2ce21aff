"""Migration 0010 on SQLite and PostgreSQL: the seeded plans lose the per-request prices 0001 gave them
(so a stock deployment sells Pro and Premium at their monthly price alone), an operator's own price
survives the upgrade and the downgrade, and the downgrade puts the seeded prices back."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, text

from flatfare.storage.db import alembic_config
from tests.conftest import sync_url

SEEDED_0001 = {"free": 0, "pro": 2000, "premium": 1500, "enterprise": 1000, "trial": 0}


def _prices(url: str) -> dict[str, int]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return dict(conn.execute(text("SELECT name, price_per_request_micros FROM plans")).all())
    finally:
        engine.dispose()


def _set(url: str, plan: str, micros: int) -> None:
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE plans SET price_per_request_micros = :m WHERE name = :n"),
                         {"m": micros, "n": plan})
    finally:
        engine.dispose()


def test_the_seeded_plans_are_flat_and_an_operators_price_survives(database_url: str) -> None:
    assert _prices(database_url) == dict.fromkeys(SEEDED_0001, 0)  # head: every seeded plan flat
    command.downgrade(alembic_config(database_url), "0009")
    assert _prices(database_url) == SEEDED_0001
    _set(database_url, "premium", 2500)  # an operator's own price before upgrading
    command.upgrade(alembic_config(database_url), "head")
    assert _prices(database_url) == {**dict.fromkeys(SEEDED_0001, 0), "premium": 2500}
    command.downgrade(alembic_config(database_url), "0009")
    assert _prices(database_url) == {**SEEDED_0001, "premium": 2500}
