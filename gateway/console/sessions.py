"""Console sessions, kept server-side in Redis: the cookie carries only a random id.

Every visitor gets a session (an anonymous one first), so every form, the login form included,
carries a CSRF token tied to it. Logging in ends that session and starts one under a new id: an id
planted in a victim's browser before login (session fixation) is worth nothing after it. Redis keeps
a session under the SHA-256 of its id, so a copy of Redis holds no usable cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import Response

from flatfare.gateway.console.keyspace import console_session_key, console_user_sessions_key

# 256 random bits, URL-safe: 43 characters. A cookie of any other shape is not looked up.
_ID_BYTES = 32
_ID_LENGTH = 43
# An anonymous session (only a CSRF token for the login and sign-up forms) lives briefly.
ANONYMOUS_TTL_S = 3600


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """Who a console request comes from. ``user_id`` is set for a logged-in user; ``admin`` for an
    admin (by admin token: ``admin_token_id``; or a user whose ``is_admin`` is set)."""

    id_hash: str
    csrf: str
    user_id: int | None = None
    account_id: int | None = None
    email: str = ""
    admin: bool = False
    admin_token_id: int | None = None
    admin_name: str = ""
    # The user's password generation when the session started (:func:`password_stamp`): a session from
    # before a password change or reset is refused, even one that outlived the per-user index.
    password_stamp: str = ""

    @property
    def logged_in(self) -> bool:
        return self.user_id is not None or self.admin

    def csrf_matches(self, candidate: str | None) -> bool:
        return bool(candidate) and hmac.compare_digest(self.csrf.encode(), candidate.encode())

    def fields(self) -> dict[str, str]:
        return {"csrf": self.csrf, "user_id": _opt(self.user_id), "account_id": _opt(self.account_id),
                "email": self.email, "admin": "1" if self.admin else "",
                "admin_token_id": _opt(self.admin_token_id), "admin_name": self.admin_name,
                "password_stamp": self.password_stamp}

    @classmethod
    def from_fields(cls, id_hash: str, raw: dict[bytes, bytes]) -> ConsoleSession:
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(id_hash=id_hash, csrf=f["csrf"], user_id=_int(f.get("user_id")),
                   account_id=_int(f.get("account_id")), email=f.get("email", ""), admin=bool(f.get("admin")),
                   admin_token_id=_int(f.get("admin_token_id")), admin_name=f.get("admin_name", ""),
                   password_stamp=f.get("password_stamp", ""))


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def _int(value: str | None) -> int | None:
    return int(value) if value else None


def password_stamp(password_hash: str) -> str:
    """A password's generation: changes with every new hash (Argon2 salts each one), reveals nothing."""
    return hashlib.sha256(b"console-password-stamp:" + password_hash.encode()).hexdigest()[:32]


def stamp_matches(session: ConsoleSession, password_hash: str) -> bool:
    return hmac.compare_digest(session.password_stamp.encode(), password_stamp(password_hash).encode())


def hash_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class ConsoleSessions:
    """Creates, reads, renews and ends console sessions."""

    def __init__(self, redis: Redis, *, idle_s: int, secure: bool) -> None:
        self._redis = redis
        self._idle_s = idle_s
        self.secure = secure
        # The __Host- prefix makes the browser insist on Secure, Path=/ and no Domain: a sibling
        # subdomain cannot plant the cookie. Plain http (local mode) cannot use it.
        self.cookie_name = "__Host-ff_console" if secure else "ff_console"

    async def load(self, request: Request) -> ConsoleSession | None:
        """The request's session, renewed for another idle period; None if it has none or it ended."""
        session_id = request.cookies.get(self.cookie_name, "")
        if len(session_id) != _ID_LENGTH:
            return None
        id_hash = hash_id(session_id)
        key = console_session_key(id_hash)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.ttl(key)
            raw, ttl = await pipe.execute()
        if not raw:
            return None
        session = ConsoleSession.from_fields(id_hash, raw)
        if session.logged_in and ttl < self._idle_s - 60:  # renew at most once a minute
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.expire(key, self._idle_s)
                if session.user_id is not None:  # the index must outlive every session it lists
                    pipe.expire(console_user_sessions_key(session.user_id), self._idle_s)
                await pipe.execute()
        return session

    async def start(self, response: Response, *, user_id: int | None = None, account_id: int | None = None,
                    email: str = "", admin: bool = False, admin_token_id: int | None = None,
                    admin_name: str = "", password_hash: str = "",
                    replacing: ConsoleSession | None = None) -> ConsoleSession:
        """A new session under a new id (the one it replaces ends), and its cookie on ``response``."""
        if replacing is not None:
            await self.end(replacing)
        session_id = secrets.token_urlsafe(_ID_BYTES)
        session = ConsoleSession(id_hash=hash_id(session_id), csrf=secrets.token_urlsafe(32), user_id=user_id,
                                 account_id=account_id, email=email, admin=admin, admin_token_id=admin_token_id,
                                 admin_name=admin_name,
                                 password_stamp=password_stamp(password_hash) if password_hash else "")
        ttl = self._idle_s if session.logged_in else ANONYMOUS_TTL_S
        key = console_session_key(session.id_hash)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=session.fields())
            pipe.expire(key, ttl)
            if user_id is not None:
                index = console_user_sessions_key(user_id)
                pipe.sadd(index, session.id_hash)
                pipe.expire(index, self._idle_s)
            await pipe.execute()
        response.set_cookie(self.cookie_name, session_id, max_age=None, path="/", secure=self.secure,
                            httponly=True, samesite="lax")
        return session

    async def end(self, session: ConsoleSession, response: Response | None = None) -> None:
        await self._redis.delete(console_session_key(session.id_hash))
        if session.user_id is not None:
            await self._redis.srem(console_user_sessions_key(session.user_id), session.id_hash)
        if response is not None:
            response.delete_cookie(self.cookie_name, path="/", secure=self.secure, httponly=True, samesite="lax")

    async def end_all(self, user_id: int, keep: ConsoleSession | None = None) -> None:
        """End every session of the user (after a password change or reset), except ``keep``."""
        index = console_user_sessions_key(user_id)
        hashes = {h.decode() for h in await self._redis.smembers(index)}
        if keep is not None:
            hashes.discard(keep.id_hash)
        if hashes:
            await self._redis.delete(*(console_session_key(h) for h in hashes))
            await self._redis.srem(index, *hashes)
