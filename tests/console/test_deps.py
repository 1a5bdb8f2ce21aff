"""The console's dependencies (flatfare.gateway.console.deps) on the shared live stack: a form with a NUL
byte is a 400 with an error body."""

from __future__ import annotations


import pytest

from tests.conftest import Stack
from tests.console.conftest import ConsoleClient


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
