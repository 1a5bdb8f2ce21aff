"""FastAPI dependencies as ``Annotated`` aliases: the caller, the bounded body, the services."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.auth import Authenticator, Caller
from gateway.completions import CompletionService
from gateway.errors import APIError
from gateway.pools import Pools


async def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    authenticator: Authenticator = request.app.state.authenticator
    caller = await authenticator.authenticate(authorization)
    request.state.caller = caller  # for the rate-limit headers of every /v1 response
    return caller


async def _body(request: Request) -> bytes:
    """The request body, refused with 413 as soon as it passes the configured limit."""
    limit: int = request.app.state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this platform's limit of {limit} bytes.",
                    code="request_too_large")


# Async on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and
# an anyio cancel scope) on every request for a mere attribute read.
async def _service(request: Request) -> CompletionService:
    return request.app.state.completions


async def _pools(request: Request) -> Pools:
    return request.app.state.pools


CurrentCaller = Annotated[Caller, Depends(_caller)]
RawBody = Annotated[bytes, Depends(_body)]
ServiceDep = Annotated[CompletionService, Depends(_service)]
PoolsDep = Annotated[Pools, Depends(_pools)]
