"""API key format and hashing.

A key reads ``ff-`` followed by 43 URL-safe characters (256 random bits), so secret scanners can
match ``ff-[A-Za-z0-9_-]{43}``; admin tokens read ``ffa-`` and 43 more. Only its SHA-256 is stored: with 256 bits of entropy a slow hash
adds nothing, and a fast one keeps authentication off the request's critical path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "ff-"
ADMIN_PREFIX = "ffa-"
VISIBLE_CHARS = 8
_SECRET_BYTES = 32


def new_key(prefix: str = KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(_SECRET_BYTES)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def visible_prefix(key: str) -> str:
    return key[: key.index("-") + 1 + VISIBLE_CHARS]


def looks_like_key(candidate: str, prefix: str = KEY_PREFIX) -> bool:
    return candidate.startswith(prefix) and len(candidate) == len(prefix) + 43


def hashes_match(stored_hash: str, key: str) -> bool:
    return hmac.compare_digest(stored_hash, hash_key(key))
