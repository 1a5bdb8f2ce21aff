"""Telling people about a shared API key (flatfare.gateway.shared_keys): the owner, by a banner on the
console's overview and Keys pages and one email a key and day; the operator, on the account's admin
page and the admin dashboard. The email is sent by a background pass in every gateway process, never
on a request's path; a Redis SET NX makes it once per key and day whichever process sees it first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select

from flatfare.gateway.app_state import Services
from flatfare.gateway.console.mail import Mailer
from flatfare.gateway.shared_keys import SharedKeys, recent_days, sighting_day
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.gateway.roles import Area, roles_with
from flatfare.storage.accounts import member_emails
from flatfare.storage.models import Account, ApiKey

log = logging.getLogger("flatfare.console")

SUBJECT = "A Flatfare API key of yours is used from many addresses"
# The most flagged keys a page lists, and the most keys looked up for them.
MAX_LISTED = 20
MAX_LOOKED_UP = 1000


@dataclass(frozen=True, slots=True)
class SharedKey:
    """A key listed as shared on ``day``: its distinct client addresses and user agents that day."""

    key_id: int
    label: str
    account_id: int
    account_name: str
    addresses: int
    agents: int
    day: str


def _label(key: ApiKey) -> str:
    return f"'{key.name}' ({key.prefix}...)" if key.name else f"{key.prefix}..."


async def shared_keys_of(services: Services, account_id: int | None = None, *,
                         now: datetime | None = None) -> list[SharedKey]:
    """Today's (UTC) shared keys, of one account (its live keys looked up in the day's set) or (None) of
    every account, most addresses first. Redis away: none (a page never fails for a warning)."""
    shared: SharedKeys = services.shared_keys
    day = sighting_day(now or datetime.now(UTC))
    query = select(ApiKey, Account.name).join(Account, Account.id == ApiKey.account_id).where(
        ApiKey.revoked_at.is_(None))
    try:
        if account_id is None:
            ids = sorted(await shared.shared(day))[:MAX_LOOKED_UP]
            if not ids:
                return []
            query = query.where(ApiKey.id.in_(ids))
        else:
            query = query.where(ApiKey.account_id == account_id).order_by(ApiKey.id.desc()).limit(MAX_LOOKED_UP)
        async with services.sessions() as db:
            rows = list((await db.execute(query)).all())
        if account_id is not None:
            listed = await shared.listed([key.id for key, _ in rows], day)
            rows = [(key, name) for key, name in rows if key.id in listed]
        counts = await shared.counts([key.id for key, _ in rows], day)
    except REDIS_DOWN:
        return []
    found = [SharedKey(key.id, _label(key), key.account_id, name, *counts[key.id], day) for key, name in rows]
    return sorted(found, key=lambda k: -k.addresses)[:MAX_LISTED]


async def tell_owners(services: Services, now: datetime | None = None) -> int:
    """One pass: email the owners of keys newly listed as shared (today's or yesterday's, UTC), once a key
    and day. Returns how many keys' owners were told."""
    shared: SharedKeys = services.shared_keys
    await shared.start()
    told = 0
    for day in recent_days(now or datetime.now(UTC)):
        for key_id in sorted(await shared.shared(day)):
            if await shared.first_to_tell(key_id, day):
                await _tell(services, key_id, day)
                told += 1
    return told


async def _tell(services: Services, key_id: int, day: str) -> None:
    async with services.sessions() as db:
        key = await db.get(ApiKey, key_id)
        if key is None:
            return
        emails = await member_emails(db, key.account_id, roles_with(Area.KEYS))
    addresses, agents = (await services.shared_keys.counts([key_id], day))[key_id]
    settings = services.settings
    text = (f"On {day} (UTC) your API key {_label(key)} was used from {addresses} different client addresses "
            f"with {agents} different user agents, more than your plan expects of one person or service. If you "
            "shared it, give each person or service a key of their own (Keys page of the console: "
            f"{settings.public_url}/console/keys) and revoke or rotate this one; if you did not, it has leaked: "
            "rotate it now. Addresses are counted as keyed hashes, never stored themselves.")
    mailer = Mailer(settings)
    for email in emails:
        await mailer.send(email, SUBJECT, text)


async def run(services: Services, stop: asyncio.Event, every_s: float) -> None:
    """Until ``stop``: a pass of :func:`tell_owners` every ``every_s``. Redis or the database away: the
    next pass tries again (a key already marked told stays told)."""
    while not stop.is_set():
        try:
            await tell_owners(services)
        except (*REDIS_DOWN, *DATABASE_DOWN) as exc:
            log.warning("shared-key notices not sent this pass: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
