"""Migration 0020 on SQLite and PostgreSQL: every console user who had an account before teams becomes
its owner (an admin user without one, no member of anything); the downgrade takes the team tables away."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, inspect, text

from flatfare.storage.db import alembic_config
from tests.conftest import sync_url


def test_existing_console_users_become_owners_of_their_account(database_url: str) -> None:
    config = alembic_config(database_url)
    command.downgrade(config, "0019")
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            account = conn.execute(text("INSERT INTO accounts (name, plan, status, unlimited) "
                                        "VALUES ('before-teams', 'free', 'active', FALSE) RETURNING id")).scalar()
            for email, account_id, admin in (("dev@example.com", account, False), ("ops@example.com", None, True)):
                conn.execute(text("INSERT INTO console_users (email, password_hash, account_id, is_admin) "
                                  "VALUES (:e, 'x', :a, :i)"), {"e": email, "a": account_id, "i": admin})
        command.upgrade(config, "head")
        with engine.connect() as conn:
            members = conn.execute(text("SELECT u.email, m.account_id, m.role FROM account_members m "
                                        "JOIN console_users u ON u.id = m.user_id")).all()
        assert [tuple(m) for m in members] == [("dev@example.com", account, "owner")]
        command.downgrade(config, "0019")
        assert "account_members" not in inspect(engine).get_table_names()
        command.upgrade(config, "head")
    finally:
        engine.dispose()
