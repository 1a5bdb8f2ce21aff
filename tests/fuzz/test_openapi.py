"""Schemathesis against the gateway's own OpenAPI schema, ``/v1`` and ``/admin/v1``: whatever it
generates (valid bodies, broken ones, odd path and query values), the platform never answers 5xx, and
every documented response matches its schema. Bounded (a few examples per operation, no stateful
phase) so the whole run stays well under a minute.

It runs against a live stack on the instant engine, with real credentials for each API: generated
requests that the schema calls valid go all the way through quota, queue and engine. Path ids that
would revoke or rotate the fuzzer's own key or token are swapped for unknown ones (404) so that one
example cannot lock the rest out."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import Stack, launch_admin_stack

pytestmark = pytest.mark.e2e

MODEL = "instant"
EXAMPLES = 15
UNKNOWN_ID = 10**9
# The fuzzer's own credentials live under these ids; an example naming them gets an unknown id instead.
_PROTECTED = ("account_id", "key_id", "token_id")


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis' not_a_server_error, except the documented 503 of billing routes on a platform
    without Stripe (this one): configuration, not a fault."""
    billing = response.status_code == 503 and case.path.startswith("/v1/billing/")
    if billing and response.json().get("error", {}).get("code") == "billing_not_configured":
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [no_server_error, response_schema_conformance, content_type_conformance]
# Operations whose schema documents their error answers too (flatfare.gateway.errors.ERROR_RESPONSES): every
# status they send must be a documented one. The completion routes (gateway/openai/routes.py) do not yet.
DOCUMENTED_ERRORS = re.compile(r"^/(admin/v1/|v1/usage$)")
CONFIG = schemathesis.config.SchemathesisConfig.from_dict({
    "phases": {"stateful": {"enabled": False}, "coverage": {"enabled": False}},
    "generation": {"max-examples": EXAMPLES},
})


@pytest.fixture(scope="module")
def fstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_admin_stack(tmp_path_factory.mktemp("fuzz"), "fuzz") as stack:
        ids = stack.sql("SELECT k.account_id, k.id FROM api_keys k")[0]
        stack.protected = {"account_id": ids[0], "key_id": ids[1],  # type: ignore[attr-defined]
                           "token_id": stack.sql("SELECT id FROM admin_tokens")[0][0]}
        yield stack


@pytest.fixture(scope="module")
def api(fstack: Stack) -> Any:
    return schemathesis.openapi.from_url(f"{fstack.base_url}/openapi.json", config=CONFIG)


def call(case: Any, fstack: Stack) -> None:
    for name in _PROTECTED:
        if (case.path_parameters or {}).get(name) == fstack.protected[name]:
            case.path_parameters[name] = UNKNOWN_ID
    credential = fstack.admin_token if case.path.startswith("/admin/") else fstack.api_key
    headers = dict(case.headers or {})
    if not any(name.lower() == "authorization" for name in headers):
        headers["Authorization"] = f"Bearer {credential}"
    case.headers = headers
    checks = [*CHECKS, status_code_conformance] if DOCUMENTED_ERRORS.match(case.path) else CHECKS
    case.call_and_validate(base_url=fstack.base_url, checks=checks, timeout=30)


# The pytest plugin's lazy schemas need pytest < 9 (they set Function._nodeid), so the operations are
# walked here: each is one Hypothesis run, bounded, without shrinking, and every failure is reported.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("prefix", ["/v1/", "/admin/v1/"])
def test_no_5xx_and_no_response_outside_the_schema(api: Any, fstack: Stack, prefix: str,
                                                    mode: GenerationMode) -> None:
    failures: list[str] = []
    operations = [result.ok() for result in api.include(path_regex=f"^{re.escape(prefix)}").get_all_operations()]
    assert operations, f"the schema documents nothing under {prefix}"
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            call(case, fstack)

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing in the operation can be made invalid
        except Exception as exc:  # noqa: BLE001 - every operation's failure is collected, then reported
            failures.append(f"{operation.label}: {exc}"[:3000])
    assert not failures, "\n\n".join(failures)
