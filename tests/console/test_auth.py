"""The console's login routes (flatfare.gateway.console.auth) on the shared live stack: an admin user with no
account of their own is sent to the admin pages, not round a redirect loop."""

from __future__ import annotations


import pytest
from argon2 import PasswordHasher

from tests.conftest import Stack
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts, new_email


@pytest.mark.e2e
def test_an_admin_user_without_an_account_is_sent_to_the_admin_pages(stack: Stack) -> None:
    email = new_email("admin")
    stack.sql("INSERT INTO console_users (email, password_hash, account_id, is_admin, email_verified_at) "
              "VALUES (:e, :h, NULL, TRUE, CURRENT_TIMESTAMP)", e=email, h=PasswordHasher().hash(PASSWORD))
    admin = ConsoleClient(stack)
    try:
        clear_attempts(stack.redis_url)
        admin.get("/console/login")
        login = admin.post("/console/login", {"email": email, "password": PASSWORD})
        assert login.status_code == 303 and login.headers["location"] == "/console/admin"
        again = admin.http.get("/console/login")  # already logged in: straight to the admin pages
        assert again.status_code == 303 and again.headers["location"] == "/console/admin"
        page = admin.http.get("/console/admin")
        assert page.status_code == 200
        assert 'class="brand" href="/console/admin"' in page.text
    finally:
        admin.close()
        clear_attempts(stack.redis_url)
