"""OpenAI's rate-limit headers on every authenticated ``/v1`` response."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flatfare.billing.plans import QuotaWindow, openai_duration, quota_window
from flatfare.billing.quota import QuotaUnavailable
from flatfare.gateway.app_state import Services

if TYPE_CHECKING:
    from flatfare.gateway.auth import Caller


def ratelimit_headers(limit: int | None, used: int, window: QuotaWindow, now: datetime) -> dict[str, str]:
    """Unlimited accounts get no limit headers: there is nothing to count down."""
    if limit is None:
        return {}
    return {
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": str(max(limit - used, 0)),
        "x-ratelimit-reset-requests": openai_duration(window.seconds_left(now)),
    }


class RateLimitHeaders:
    """Adds the headers the request's quota step computed, or reads the counter for other routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = await self._headers(scope)
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in headers.items() if k.encode() not in present]
                if extra:
                    message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)

    @staticmethod
    async def _headers(scope: Scope) -> dict[str, str]:
        state = scope.get("state", {})
        if "ratelimit" in state:
            return state["ratelimit"]
        caller = state.get("caller")
        if caller is None:
            return {}
        return await current_headers(scope["app"].state.services, caller)


async def current_headers(app_state: Services, caller: Caller) -> dict[str, str]:
    """The caller's rate-limit headers read from the counter (for answers that counted nothing)."""
    now = datetime.now(UTC)
    try:
        terms = await app_state.plans.terms(caller.account, now)
        window = quota_window(terms.plan.timezone, now)
        used = await app_state.quota.used(caller.account_id, window.day)
    except QuotaUnavailable:
        return {}
    return ratelimit_headers(terms.daily_limit, used, window, now)
