"""The admin API's mass-assignment refusals in-process: each write body of test_http.py's
MASS_ASSIGNMENTS is refused by the route's wire model alone, within 100 ms (timing.FAST_S), naming the
same field the HTTP answer names. test_http.py checks the same bodies through the running gateway
(bounded there by OVER_HTTP_S) and that nothing was written."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from flatfare.gateway.admin import catalog_schemas, schemas
from flatfare.gateway.errors import validation_error
from tests.security.test_http import MASS_ASSIGNMENTS
from tests.security.timing import fast

# The wire model each admin route validates its body with (gateway/admin/*.py).
ROUTE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/accounts"): schemas.AccountCreate,
    ("PATCH", "/accounts/{victim}"): schemas.AccountUpdate,
    ("POST", "/accounts/{victim}/keys"): schemas.KeyCreate,
    ("POST", "/models"): catalog_schemas.ModelCreate,
    ("PATCH", "/plans/pro"): schemas.PlanUpdate,
    ("POST", "/tokens"): schemas.TokenCreate,
}


@pytest.mark.parametrize(("method", "path", "body", "param"), MASS_ASSIGNMENTS)
def test_the_wire_model_refuses_fields_that_are_not_the_callers(method: str, path: str, body: dict[str, Any],
                                                                param: str | None) -> None:
    model = ROUTE_MODELS[(method, path)]

    def attempt() -> ValidationError:
        with pytest.raises(ValidationError) as caught:
            model.model_validate(body)
        return caught.value

    errors = fast(attempt).errors()
    if param is not None:
        named = validation_error(list(errors), body).param or ".".join(str(p) for p in errors[0]["loc"])
        assert named == param, errors
