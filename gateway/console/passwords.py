"""Password hashing with Argon2id (argon2-cffi's RFC 9106 low-memory profile), off the event loop."""

from __future__ import annotations

import asyncio

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

# 64 MiB and 3 passes: RFC 9106's second recommended option; about 50-100 ms on one core here.
_HASHER = PasswordHasher()
# Verified against when no user has the email, so a login for an unknown address costs the same
# time as one for a known address with a wrong password (no enumeration by timing).
_DECOY = _HASHER.hash("not a password anyone has: flatfare decoy")
# Argon2 hashes the whole input: a cap keeps a megabyte "password" from costing more than it should.
MAX_PASSWORD_LENGTH = 256


async def hash_password(password: str) -> str:
    return await asyncio.to_thread(_HASHER.hash, password)


async def verify_password(stored_hash: str | None, password: str) -> bool:
    """Whether ``password`` matches ``stored_hash``; with no hash, a decoy check of the same cost."""
    def check() -> bool:
        try:
            return _HASHER.verify(stored_hash or _DECOY, password) and stored_hash is not None
        except (VerificationError, InvalidHashError):
            return False

    return await asyncio.to_thread(check)
