"""The answer to a request the admission script refused: nothing was counted, queued or held, and
the error says which limit was hit, when to retry, and what is left (OpenAI's rate-limit headers)."""

from __future__ import annotations

from datetime import datetime

from redis.exceptions import RedisError

from flatfare.billing.plans import AccountTerms, QuotaWindow
from flatfare.billing.quota import QuotaUnavailable
from flatfare.gateway.auth import Caller
from flatfare.gateway.errors import APIError
from flatfare.gateway.jobpath.queueing import KeyQuotaSpent, KeyShared, QuotaSpent, TooManyInFlight
from flatfare.gateway.quota_headers import ratelimit_headers


def key_ratelimit(limit: int, used: int) -> dict[str, str]:
    """The key's own cap beside the account's headers (which stay the account's)."""
    return {"x-ratelimit-limit-requests-key": str(limit),
            "x-ratelimit-remaining-requests-key": str(max(limit - used, 0))}


def refusal(exc: BaseException, terms: AccountTerms, window: QuotaWindow, now: datetime,
            caller: Caller) -> BaseException:
    """The client's error for a request the admission script refused (nothing was counted)."""
    if isinstance(exc, KeyShared):
        return APIError(429, f"The API key {caller.key.label} was used from {exc.inflight} other client addresses "
                        f"in the last minutes, the most the {terms.plan.name} plan allows at once; a key is for one "
                        "person or service: give each user a key of their own (the console's Keys page), or retry "
                        "from one of those addresses.", code="key_shared_too_widely", headers={"Retry-After": "60"})
    if isinstance(exc, TooManyInFlight):
        if exc.key:
            return APIError(429, f"The API key {caller.key.label} has {exc.inflight} requests in flight, the most "
                            f"it may have at once ({caller.key.max_inflight}); retry when one has finished.",
                            code="key_too_many_inflight", headers={"Retry-After": "1"})
        return APIError(429, f"Your account has {exc.inflight} requests in flight, the most it may have at "
                        f"once ({terms.max_inflight} on the {terms.plan.name} plan); retry when one has finished.",
                        code="too_many_inflight", headers={"Retry-After": "1"})
    if isinstance(exc, KeyQuotaSpent):
        seconds = window.seconds_left(now)
        return APIError(
            429, f"The API key {caller.key.label} has used all {caller.key.daily_limit} requests it may make "
            f"today ({window.day}); its allowance resets in {seconds} s. Other keys of the account are not "
            "affected.", code="key_rate_limit_exceeded",
            headers={"Retry-After": str(seconds), **ratelimit_headers(terms.daily_limit, exc.used, window, now),
                     **key_ratelimit(caller.key.daily_limit or 0, exc.key_used)})
    if isinstance(exc, QuotaSpent):
        seconds = window.seconds_left(now)
        return APIError(
            429, f"You have used all {terms.daily_limit} requests of your {terms.plan.name} plan for today "
            f"({window.day}); the allowance resets in {seconds} s.", code="rate_limit_exceeded",
            headers={"Retry-After": str(seconds), **ratelimit_headers(terms.daily_limit, exc.used, window, now)})
    if isinstance(exc, QuotaUnavailable):
        return APIError(503, "Request quotas cannot be checked right now; retry shortly.",
                        code="quota_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, RedisError):
        return APIError(503, "The request queue is unreachable; retry shortly.", code="queue_unavailable",
                        headers={"Retry-After": "1"})
    return exc  # a full lane's 429, or anything else, as it is
