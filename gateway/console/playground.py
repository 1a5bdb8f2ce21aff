"""The playground: chat with a model the plan allows, streamed. Each message is a real API request:
the console hands it to the gateway's own CompletionService (the handler behind
``/v1/chat/completions``) as the account's "Console playground" key, so the plan's limits, the daily
quota, the queue and the ledger apply exactly as to any API call. That key is an ordinary key of the
account, listed on the keys page; its secret is never kept (the console acts as the key by its id,
after the same checks the API's authenticator makes)."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select
from starlette.background import BackgroundTask

from flatfare.contract import Endpoint
from flatfare.gateway.auth import Caller, caller_of
from flatfare.gateway.console.deps import CsrfChecked, Customer, KeysMember
from flatfare.gateway.console.keys import PLAYGROUND_KEY_NAME
from flatfare.gateway.console.plan_models import plan_models
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError, error_body
from flatfare.gateway.openai.asgi import read_body
from flatfare.gateway.openai.relay import Call
from flatfare.storage.accounts import issue_key
from flatfare.storage.models import Account, AccountStatus, ApiKey
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)

MAX_CHAT_BYTES = 256 * 1024
MAX_TURNS = 50


class Turn(BaseModel):
    role: str = Field(pattern="^(user|assistant|system)$")
    content: str = Field(max_length=32_000)


class PlaygroundChat(BaseModel):
    model: str = Field(min_length=1, max_length=128)
    messages: list[Turn] = Field(min_length=1, max_length=MAX_TURNS)
    max_tokens: int = Field(default=256, ge=1, le=4096)
    temperature: float = Field(default=0.7, ge=0, le=2)


@router.get("/playground")
async def playground_page(request: Request, customer: KeysMember) -> Response:
    return render(request, "playground.html", {"customer": customer, "key_name": PLAYGROUND_KEY_NAME,
                                               "models": await plan_models(request, customer.account, chat=True)})


async def playground_caller(request: Request, customer: Customer) -> Caller:
    """The account's playground key as the API's authenticator would return it (made if the account has
    none that works)."""
    now = datetime.now(UTC)
    async with services_of(request).sessions() as db, db.begin():
        account = await db.get(Account, customer.account.id)
        if account.status != AccountStatus.ACTIVE:
            raise APIError(403, f"The account '{account.name}' is {account.status.replace('_', ' ')}; "
                           "contact the platform's administrators.", code="account_inactive")
        keys = await db.scalars(select(ApiKey).where(ApiKey.account_id == account.id, ApiKey.name == PLAYGROUND_KEY_NAME,
                                                     ApiKey.revoked_at.is_(None)).order_by(ApiKey.id.desc()))
        key = next((k for k in keys if k.expires_at is None or k.expires_at > now), None)
        if key is None:
            key = await db.get(ApiKey, (await issue_key(db, account, PLAYGROUND_KEY_NAME)).key_id)
        key.last_used_at = now
        db.expunge(account)
        return caller_of(account, key)


@router.post("/playground/chat")
async def chat(request: Request, customer: KeysMember, _: CsrfChecked) -> Response:
    raw = await read_body(request.receive, request.headers.get("content-length"), MAX_CHAT_BYTES)
    try:
        chat = PlaygroundChat.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}", code="invalid_request") from exc
    body = orjson.dumps({"model": chat.model, "messages": [t.model_dump() for t in chat.messages], "stream": True,
                         "max_tokens": chat.max_tokens, "temperature": chat.temperature,
                         "stream_options": {"include_usage": True}})
    caller = await playground_caller(request, customer)
    try:
        answer = await services_of(request).completions.handle(Endpoint.CHAT, body, caller, Call({}))
    except APIError as exc:
        return Response(orjson.dumps(error_body(exc.status, exc.message, param=exc.param, code=exc.code)),
                        status_code=exc.status, media_type="application/json", headers=exc.headers)
    headers = {k: v for k, v in answer.headers.items() if k.lower().startswith(("x-request-id", "x-ratelimit"))}
    after = BackgroundTask(answer.after) if answer.after is not None else None
    if answer.stream is None:
        return Response(answer.body, status_code=answer.status, media_type=answer.media_type, headers=headers,
                        background=after)
    return StreamingResponse(answer.stream, status_code=answer.status, media_type="text/event-stream",
                             headers=headers, background=after)
