"""Every credential Flatfare issues is masked in any log line, whatever wrote it: API keys and admin
tokens keep only the visible prefix stored beside their hash."""

from __future__ import annotations

from flatfare.logs import redact
from flatfare.storage.keys import ADMIN_PREFIX, KEY_PREFIX, new_key, visible_prefix


def test_api_keys_and_admin_tokens_are_masked_to_their_visible_prefix() -> None:
    for prefix in (KEY_PREFIX, ADMIN_PREFIX):
        secret = new_key(prefix)
        line = redact(f"refused {secret} at once; again: '{secret}'")
        assert secret not in line
        assert line.count(visible_prefix(secret) + "[redacted]") == 2


def test_bearer_headers_are_masked_whole() -> None:
    assert redact("Authorization: Bearer ffa-whatever.it.is") == "Authorization: [redacted]"
