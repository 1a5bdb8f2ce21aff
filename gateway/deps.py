"""FastAPI dependencies as ``Annotated`` aliases: the caller, the bounded body, the services."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from flatfare.gateway.auth import Authenticator, Caller
from flatfare.gateway.openai.asgi import read_body
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.jobpath.pools import Pools
from flatfare.gateway.app_state import services_of


async def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    authenticator: Authenticator = services_of(request).authenticator
    caller = await authenticator.authenticate(authorization)
    request.state.caller = caller  # for the rate-limit headers of every /v1 response
    return caller


async def _body(request: Request) -> bytes:
    """The request body, refused with 413 as soon as it passes the configured limit."""
    return await read_body(request.receive, request.headers.get("content-length"),
                           services_of(request).settings.max_body_bytes)


# Async on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and
# an anyio cancel scope) on every request for a mere attribute read.
async def _pools(request: Request) -> Pools:
    return services_of(request).pools


async def _plans(request: Request) -> PlanBook:
    return services_of(request).plans


CurrentCaller = Annotated[Caller, Depends(_caller)]
RawBody = Annotated[bytes, Depends(_body)]
PoolsDep = Annotated[Pools, Depends(_pools)]
PlansDep = Annotated[PlanBook, Depends(_plans)]
