"""API keys and admin tokens against injection and timing: a presented key only ever reaches SQL as
its SHA-256 (a bound parameter), and is compared to the stored hash in constant time, so neither
its text nor how much of it is right changes what the database sees or how long a refusal takes."""

from __future__ import annotations

import secrets
import statistics
import time

import pytest
from sqlalchemy import func, select

from flatfare.storage.accounts import ensure_account, issue_admin_token, issue_key
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import AdminToken, ApiKey
from flatfare.gateway.admin.auth import AdminAuthenticator
from flatfare.gateway.auth import Authenticator
from flatfare.gateway.errors import APIError
from tests.security.timing import fast_async

INJECTIONS = ["' OR '1'='1' -- ", "'; DROP TABLE api_keys; --", "\" OR 1=1 UNION SELECT key_hash FROM api_keys --",
              "%' OR key_hash LIKE '%", "\\'; SELECT pg_sleep(5); --"]


def padded(prefix: str, payload: str) -> str:
    """The payload as a well-formed key (prefix + 43 characters), so it gets past the format check."""
    return prefix + (payload * 43)[:43]


@pytest.fixture
async def sessions(database_url: str):
    engine = create_engine(database_url, pool_size=2)
    yield session_factory(engine)
    await engine.dispose()


@pytest.fixture
async def real_key(sessions) -> str:
    async with sessions() as session:
        issued = await issue_key(session, await ensure_account(session, "victim"))
        await session.commit()
    return issued.secret


async def test_sql_in_the_bearer_header_is_an_unknown_key(sessions, real_key: str) -> None:
    auth = Authenticator(sessions, ttl_s=0.0)
    headers = [form for payload in INJECTIONS
               for form in (f"Bearer {padded('ff-', payload)}", f"Bearer {payload}", f"Bearer ff-{payload}", payload)]
    for header in headers:
        async def attempt(header: str = header) -> APIError:
            with pytest.raises(APIError) as caught:
                await auth.authenticate(header)
            return caught.value

        error = await fast_async(attempt)
        assert (error.status, error.code) == (401, "invalid_api_key")
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(ApiKey)) == 1
    assert (await auth.authenticate(f"Bearer {real_key}")).account_name == "victim"


async def test_sql_in_an_admin_token_is_an_invalid_token(sessions) -> None:
    async with sessions() as session:
        await issue_admin_token(session, "ops", ["admin:read", "admin:write"], None)
        await session.commit()
    auth = AdminAuthenticator(sessions, ttl_s=0.0)
    for payload in INJECTIONS:
        with pytest.raises(APIError) as caught:
            await auth.authenticate(f"Bearer {padded('ffa-', payload)}")
        assert (caught.value.status, caught.value.code) == (401, "invalid_admin_token")
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(AdminToken)) == 1


async def test_a_nearly_right_key_is_refused_as_fast_as_a_random_one(sessions, real_key: str) -> None:
    """How much of a key is right must not show in the refusal's timing. Each guess is new (the
    cache never answers), and the two kinds alternate so drift in the machine's load hits both."""
    auth = Authenticator(sessions, ttl_s=0.0)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

    async def refusal_s(key: str) -> float:
        started = time.perf_counter()
        with pytest.raises(APIError):
            await auth.authenticate(f"Bearer {key}")
        return time.perf_counter() - started

    near, far = [], []
    for i in range(300):
        tail = alphabet[i % 64] + alphabet[(i // 64) % 64]
        guess = real_key[:-2] + tail
        if guess == real_key:
            continue
        near.append(await refusal_s(guess))  # 41 of 43 secret characters right
        far.append(await refusal_s("ff-" + secrets.token_urlsafe(32)))
    ratio = statistics.median(near) / statistics.median(far)
    assert 0.7 < ratio < 1.4, f"median refusal: nearly right {statistics.median(near) * 1e6:.0f} us, " \
                              f"random {statistics.median(far) * 1e6:.0f} us"
