"""The console's sessions (flatfare.gateway.console.sessions) on the shared live stack: every session of a
user ends on a password change, even one that outlived the user's index of sessions, and renewing a
session renews that index."""

from __future__ import annotations


import pytest
import redis as redis_sync

from flatfare.gateway.console import keyspace
from flatfare.gateway.console.sessions import hash_id
from tests.conftest import Stack
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts


NEW_PASSWORD = "a different long passphrase"


def _redis(stack: Stack) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(stack.redis_url)


@pytest.mark.e2e
def test_a_session_that_outlived_the_users_index_still_ends_on_a_password_change(stack: Stack,
                                                                                 customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    attacker = ConsoleClient(stack)
    try:
        assert attacker.login(email).status_code == 303
        user_id = stack.sql("SELECT id FROM console_users WHERE email = :e", e=email)[0][0]
        client = _redis(stack)
        try:  # the per-user index expired while the attacker's session kept being renewed
            client.delete(keyspace.console_user_sessions_key(user_id))
        finally:
            client.close()
        customer.get("/console/account")
        changed = customer.post("/console/account/password", {"current": PASSWORD, "password": NEW_PASSWORD})
        assert changed.status_code == 303
        assert customer.http.get("/console").status_code == 200  # the one who changed it stays in
        assert attacker.http.get("/console").status_code == 303  # the session from before is refused
        assert attacker.http.get("/console/keys").status_code == 303
    finally:
        attacker.close()
        clear_attempts(stack.redis_url)


@pytest.mark.e2e
def test_renewing_a_session_renews_the_users_index_too(stack: Stack, customer: ConsoleClient) -> None:
    user_id = stack.sql("SELECT id FROM console_users WHERE email = :e",
                        e=customer.email)[0][0]  # type: ignore[attr-defined]
    index = keyspace.console_user_sessions_key(user_id)
    client = _redis(stack)
    try:  # both near their end: the next request renews the session, and must renew the index with it
        client.expire(keyspace.console_session_key(hash_id(customer.session_cookie or "")), 30)
        client.expire(index, 30)
        assert customer.http.get("/console").status_code == 200
        assert client.ttl(index) > 30
    finally:
        client.close()
