"""More of the console's security review: a rotated key keeps its expiry, a NUL in a form is a 400,
the CSV export quotes formula-like text cells, and a reset link marks the email confirmed."""

from __future__ import annotations

import re

import pytest

from flatfare.gateway.console.usage import spreadsheet_safe
from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient


@pytest.mark.e2e
def test_rotating_a_key_keeps_its_expiry(stack: Stack, customer: ConsoleClient) -> None:
    key_id, _ = customer.create_key("expiring")
    stack.sql("UPDATE api_keys SET expires_at = '2099-01-02 03:04:05' WHERE id = :k", k=key_id)
    customer.get("/console/keys")
    rotated = customer.post(f"/console/keys/{key_id}/rotate")
    assert rotated.status_code == 201, rotated.text
    (expiry,) = stack.sql("SELECT expires_at FROM api_keys WHERE account_id = (SELECT account_id FROM api_keys "
                          "WHERE id = :k) AND id > :k", k=key_id)[0]
    assert expiry is not None and str(expiry).startswith("2099-01-02 03:04:05")


@pytest.mark.e2e
def test_a_nul_byte_in_a_form_is_a_400_with_an_error_body(stack: Stack, customer: ConsoleClient) -> None:
    customer.get("/console/keys")
    for form in ({"name": "evil\x00name"}, {"name\x00": "x"}):
        refused = customer.post("/console/keys", form)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_form" and set(error) >= {"message", "type", "param", "code"}
    login = customer.post("/console/login", {"email": "a\x00@example.com", "password": "whatever at all"})
    assert login.status_code == 400


def test_every_text_cell_of_the_csv_is_guarded_after_leading_whitespace() -> None:
    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\t=1", "\r=1", "  =HYPERLINK(\"x\")", " \u00a0@x"):
        assert spreadsheet_safe(text).startswith("'"), repr(text)
    for text in ("SmolLM2-135M", "my key", "ff-abcdefgh", ""):
        assert spreadsheet_safe(text) == text


@pytest.mark.e2e
def test_a_reset_link_marks_the_email_confirmed(stack: Stack, customer: ConsoleClient) -> None:
    from tests.console.test_customer_account import NEW_PASSWORD, _reset_link

    email = customer.email  # type: ignore[attr-defined]
    stack.sql("UPDATE console_users SET email_verified_at = NULL WHERE email = :e", e=email)
    visitor = ConsoleClient(stack)
    try:
        visitor.get("/console/reset")
        assert visitor.post("/console/reset", {"email": email}).status_code == 200
        path = "/console/reset/" + _reset_link(stack, email).rsplit("/", 1)[1]
        visitor.get(path)
        assert visitor.post(path, {"password": NEW_PASSWORD}).status_code == 303
        assert stack.sql("SELECT email_verified_at FROM console_users WHERE email = :e", e=email)[0][0] is not None
    finally:
        visitor.close()



NONCE = re.compile(r'name="form_nonce" value="([^"]+)"')


@pytest.mark.e2e
def test_a_key_form_sent_twice_issues_one_key(stack: Stack, customer: ConsoleClient) -> None:
    """A browser re-posts the create (or rotate) form on refresh, and a double click sends it twice: the
    form's one-time nonce makes the second send a redirect that issues nothing."""
    def keys() -> int:
        return stack.sql("SELECT count(*) FROM api_keys WHERE account_id = (SELECT account_id FROM api_keys "
                         "WHERE id = :k)", k=key_id)[0][0]

    key_id, _ = customer.create_key("first")
    page = customer.get("/console/keys").text
    nonce = NONCE.search(page).group(1)
    before = keys()
    made = customer.post("/console/keys", {"name": "twice", "form_nonce": nonce})
    assert made.status_code == 201 and keys() == before + 1
    again = customer.post("/console/keys", {"name": "twice", "form_nonce": nonce})
    assert again.status_code == 303 and again.headers["location"] == "/console/keys?resubmitted=1"
    assert keys() == before + 1
    assert "No second key was made" in customer.get(again.headers["location"]).text
    nonce = NONCE.search(customer.get("/console/keys").text).group(1)
    assert customer.post(f"/console/keys/{key_id}/rotate", {"form_nonce": nonce}).status_code == 201
    assert customer.post(f"/console/keys/{key_id}/rotate", {"form_nonce": nonce}).status_code == 303
    assert keys() == before + 2
