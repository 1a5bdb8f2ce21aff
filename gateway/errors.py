"""OpenAI-style errors: one exception type, one envelope, handlers that map everything to it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flatfare import contract

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    return contract.error_body(message, type_ or _TYPES.get(status, "api_error"), param, code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(BaseModel):
    """The body of every error answer, as :func:`error_body` writes it (OpenAI's)."""

    error: ErrorDetail


# For a router's ``responses``: documents the error body of every 4xx (FastAPI then drops its own
# 422 body, which this API never sends).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorEnvelope, "description": "The request was refused; `error` says why."},
}


class APIError(Exception):
    """An error the client should see as ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, param=self.param, code=self.code),
                            status_code=self.status, headers=self.headers)


def queue_unreachable() -> APIError:
    """Fail closed: without Redis nothing can be counted, queued or routed."""
    return APIError(503, "The platform's queue is unreachable; retry shortly.", code="queue_unavailable",
                    headers={"Retry-After": "1"})


def database_unavailable() -> APIError:
    """The accounts and ledger database cannot be reached: nothing is counted or queued."""
    return APIError(503, "The platform's database is unreachable; retry shortly.", code="database_unavailable",
                    headers={"Retry-After": "1"})


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_from_loc(loc: tuple[Any, ...], body: Any) -> str | None:
    """``messages[0].content`` from a pydantic location, dropping the union-member names pydantic
    inserts (``...content.str``): only the steps that exist in the client's body are kept,
    plus a final missing field's name."""
    out = ""
    node = body
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str):
            out += f".{part}" if out else part
            node = node.get(part, _MISSING)
            if node is _MISSING:
                break
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out += f"[{part}]"
            node = node[part]
        else:
            break
    return out or None


_MISSING = object()


def validation_error(errors: list[dict[str, Any]], body: Any = None) -> APIError:
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[:1] in (("query",), ("path",)) and len(loc) > 1:
        param: str | None = str(loc[1])  # a query or path parameter is named as the client sent it
    else:
        param = _param_from_loc(tuple(p for p in loc if p != "body"), body)
    message = first.get("msg", "Invalid request")
    if param:
        message = f"Invalid value for '{param}': {message}"
    missing = first.get("type") == "missing"
    return invalid(message, param=param, code="missing_required_parameter" if missing else "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(list(exc.errors()), exc.body)
        if request.url.path.startswith("/admin/"):
            # The admin API follows REST conventions: a well-formed request with bad fields is 422.
            first = exc.errors()[0]
            loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
            error = APIError(422, error.message, param=error.param or ".".join(loc) or None, code=error.code)
        return error.response()

    @app.exception_handler(RedisError)
    async def _redis_down(_: Request, exc: RedisError) -> JSONResponse:
        # Fail closed: without Redis nothing can be counted, queued or routed.
        return queue_unreachable().response()

    @app.exception_handler(SQLAlchemyError)
    async def _database_down(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        return database_unavailable().response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()
