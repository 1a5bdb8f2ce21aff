"""API key format and hashing.

A key reads ``ff-`` followed by 43 URL-safe characters (256 random bits), so secret scanners can
match ``ff-[A-Za-z0-9_-]{43}``. Only its SHA-256 is stored: with 256 bits of entropy a slow hash
adds nothing, and a fast one keeps authentication off the request's critical path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "ff-"
VISIBLE_CHARS = 8
_SECRET_BYTES = 32
KEY_LENGTH = len(KEY_PREFIX) + 43


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def visible_prefix(key: str) -> str:
    return key[: len(KEY_PREFIX) + VISIBLE_CHARS]


def looks_like_key(candidate: str) -> bool:
    return candidate.startswith(KEY_PREFIX) and len(candidate) == KEY_LENGTH


def hashes_match(stored_hash: str, key: str) -> bool:
    return hmac.compare_digest(stored_hash, hash_key(key))
