"""The web console's Redis keys. A session is stored under the SHA-256 of its cookie's id, so a copy of
Redis gives no usable session; the rate-limit counters are per window. (Every other subsystem's keys
are the contract's, :mod:`flatfare.contract.keys`.)"""

from __future__ import annotations

from flatfare.contract.keys import PREFIX


def console_session_key(session_hash: str) -> str:
    """A console session (a hash: who is logged in, their CSRF token), expiring on its own."""
    return f"{PREFIX}:console:session:{session_hash}"


def console_user_sessions_key(user_id: int | str) -> str:
    """The hashes of a console user's live sessions (a set), so a password change can end them all."""
    return f"{PREFIX}:console:user-sessions:{user_id}"


def console_attempts_key(kind: str, subject: str) -> str:
    """Failed console logins (or sign-ups, resets) of one ``kind`` ("account", "address") for one
    subject (a SHA-256 of the email, the client address) in the current window: a counter."""
    return f"{PREFIX}:console:attempts:{kind}:{subject}"


def console_form_key(session_hash: str, nonce: str) -> str:
    """A key-issuing console form already submitted (its one-time nonce, per session): a browser's
    re-post on refresh finds it and issues no second key."""
    return f"{PREFIX}:console:form:{session_hash}:{nonce}"


def console_token_key(purpose: str, token_hash: str) -> str:
    """A one-time emailed token (``purpose`` "reset" or "verify") under its SHA-256: the user id."""
    return f"{PREFIX}:console:token:{purpose}:{token_hash}"


def console_checkout_key(account_id: int) -> str:
    """The plan an account last went to Stripe Checkout for, from the console (expiring): the return page
    says whether Stripe's webhook has confirmed it yet."""
    return f"{PREFIX}:console:checkout:{account_id}"
