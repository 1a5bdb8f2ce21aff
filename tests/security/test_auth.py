"""API keys and admin tokens against injection and timing: only their SHA-256 is stored; a presented
key only ever reaches SQL as its SHA-256 (a bound parameter), and is compared to the stored hash in
constant time (hmac.compare_digest), so neither its text nor how much of it is right changes what
the database sees. (The lookup is by hash, so a nearly right key misses the row as a random one
does: timing a refusal could not see the comparison, and these tests check the code's parts instead.)"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import pytest
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import event, func, select, text

from flatfare.storage.accounts import issue_admin_token, issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.keys import hash_key
from flatfare.storage.models import AdminToken, ApiKey
from flatfare.gateway.admin.auth import AdminAuthenticator
from flatfare.gateway.auth import Authenticator
from flatfare.gateway.errors import APIError
from tests.conftest import sync_url
from tests.security.timing import fast_async

INJECTIONS = ["' OR '1'='1' -- ", "'; DROP TABLE api_keys; --", "\" OR 1=1 UNION SELECT key_hash FROM api_keys --",
              "%' OR key_hash LIKE '%", "\\'; SELECT pg_sleep(5); --"]


def padded(prefix: str, payload: str) -> str:
    """The payload as a well-formed key (prefix + 43 characters), so it gets past the format check."""
    return prefix + (payload * 43)[:43]


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


def _statements(engine) -> list[str]:  # noqa: ANN001 - an AsyncEngine
    """Every statement the engine sends from now on, with its parameters, as one text each."""
    sent: list[str] = []

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def record(_conn, _cursor, statement, parameters, _context, _executemany) -> None:  # noqa: ANN001
        sent.append(f"{statement} {parameters!r}")

    return sent


@pytest.fixture
def compares(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The arguments of every constant-time comparison made from now on."""
    made: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def compare_digest(a, b):  # noqa: ANN001, ANN202 - hmac's signature
        made.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    return made


async def test_keys_and_tokens_are_stored_only_as_hashes(sessions, database_url: str) -> None:
    async with sessions() as session:
        issued = await issue_key(session, await ensure_account(session, "holder"))
        _, token = await issue_admin_token(session, "ops", ["admin:read"], None)
        await session.commit()
    engine = create_sync_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            stored = {table: [tuple(map(str, row)) for row in conn.execute(text(f"SELECT * FROM {table}"))]
                      for table in ("api_keys", "admin_tokens")}
    finally:
        engine.dispose()
    everything = repr(stored)
    for secret in (issued.secret, token):
        assert secret not in everything and secret[11:] not in everything  # not even its secret part
        assert hash_key(secret) in everything
    assert hash_key(issued.secret) == hashlib.sha256(issued.secret.encode()).hexdigest()


async def test_a_key_is_looked_up_by_its_hash_and_compared_in_constant_time(sessions, real_key: str,
                                                                           compares) -> None:
    """What reaches the database is the key's SHA-256, never the key; the one comparison with a
    stored value is hmac.compare_digest of two hashes (a plaintext compare, or `==`, fails here)."""
    auth = Authenticator(sessions, ttl_s=0.0)
    sent = _statements(sessions.kw["bind"])
    caller = await auth.authenticate(f"Bearer {real_key}")
    assert caller.account_name == "victim"
    lookups = [s for s in sent if "api_keys" in s and "SELECT" in s.upper()]
    assert lookups and all(hash_key(real_key) in s for s in lookups)
    assert not any(real_key in s or real_key[11:] in s for s in sent)
    assert compares == [(hash_key(real_key), hash_key(real_key))]
    compares.clear()
    wrong = "ff-" + secrets.token_urlsafe(32)
    with pytest.raises(APIError):
        await auth.authenticate(f"Bearer {wrong}")
    assert not any(wrong in s or wrong[11:] in s for s in sent)


async def test_an_admin_token_is_looked_up_by_its_hash_and_compared_in_constant_time(sessions, compares) -> None:
    async with sessions() as session:
        _, token = await issue_admin_token(session, "ops", ["admin:read"], None)
        await session.commit()
    auth = AdminAuthenticator(sessions, ttl_s=0.0)
    sent = _statements(sessions.kw["bind"])
    await auth.authenticate(f"Bearer {token}")
    lookups = [s for s in sent if "admin_tokens" in s and "SELECT" in s.upper()]
    assert lookups and all(hash_key(token) in s for s in lookups)
    assert not any(token in s or token[11:] in s for s in sent)
    assert compares == [(hash_key(token), hash_key(token))]
