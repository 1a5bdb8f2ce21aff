"""Quota alerts: an account is told when its day's requests pass a share of its daily quota (by default 80 %
and 100 %), by email to its console users and, when it set one, by a signed webhook.

Nothing of this runs on a request's path. One gateway process at a time (a lease in Redis, as the Stripe
outbox's) makes a pass every ``FLATFARE_QUOTA_ALERTS_EVERY_S``:

1. :meth:`QuotaAlerts.record_crossings` reads every alerting account's terms in one query and the day's
   quota counters from Redis in a few MGETs, and inserts a delivery row for each threshold crossed and
   channel. The row's unique key (account, quota day, threshold, channel) and ``ON CONFLICT DO NOTHING``
   make it one row whatever races (a second leader after a lost lease, a pass that overlapped).
2. :meth:`QuotaAlerts.send_due` sends the rows that are due. Each is claimed first by a conditional update
   of its ``attempts`` (only one claimant's update matches), so it is sent once per try; a failed try is
   retried after 1, 2, 4, ... seconds, and given up after ``FLATFARE_QUOTA_ALERTS_MAX_ATTEMPTS``.

A webhook is a POST of a JSON event, signed as Stripe signs its own: the header ``Flatfare-Signature:
t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" under the account's secret>``. Its URL must be
https and its host must resolve to public addresses only (the same check as image URLs,
:mod:`flatfare.gateway.openai.media`), both when it is saved and before each try; redirects are not followed.
Each try connects to the address that check vetted, never to a second resolution of the name (which a
name's owner could point inside the network in between: DNS rebinding); TLS still verifies the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
from sqlalchemy import or_, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.outbox import backoff
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import DailyQuota
from flatfare.contract.keys import QUOTA_ALERTS_LEADER_KEY
from flatfare.gateway.errors import APIError
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.openai import media
from flatfare.gateway.openai.screen import system_resolver
from flatfare.gateway.settings import GatewaySettings
from flatfare.leases import Lease
from flatfare.gateway.roles import Area, roles_with
from flatfare.storage.accounts import member_emails
from flatfare.storage.models import (Account, AlertChannel, AlertStatus, QuotaAlertDelivery,
                                     QuotaAlertSettings)

log = logging.getLogger("flatfare.quota_alerts")

DEFAULT_THRESHOLDS = (80, 100)
MAX_THRESHOLDS = 5
SIGNATURE_HEADER = "Flatfare-Signature"
EVENT_TYPE = "quota.threshold_reached"
SUBJECT = "Your Flatfare account reached {threshold} % of its daily quota"
SECRET_PREFIX = "whsec_"
WEBHOOK_TIMEOUT_S = 10.0
BATCH = 100
# A claimed try that never finished (its process died) is tried again after this long.
CLAIM_S = 120


class AlertSettingsError(ValueError):
    """What the owner typed cannot be saved; the message says what to change."""


class DeliveryError(Exception):
    """One try of a delivery failed; it is tried again later."""


class NothingToDeliver(DeliveryError):
    """The channel was turned off (or the account has no one to email) since the alert was recorded: no
    later try can succeed, so it is given up at once."""


@dataclass(frozen=True, slots=True)
class AlertRules:
    """An account's alerts as they apply (the defaults when it never changed them)."""

    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    email: bool = True
    webhook_url: str | None = None
    webhook_secret: str | None = None

    @classmethod
    def of(cls, row: QuotaAlertSettings | None) -> AlertRules:
        if row is None:
            return cls()
        return cls(tuple(row.thresholds), row.email_enabled, row.webhook_url, row.webhook_secret)

    def channels(self) -> list[AlertChannel]:
        return ([AlertChannel.EMAIL] if self.email else []) + ([AlertChannel.WEBHOOK] if self.webhook_url else [])


def parse_thresholds(text: str) -> tuple[int, ...]:
    """'80, 100' -> (80, 100): whole percents from 1 to 100, at most :data:`MAX_THRESHOLDS`."""
    parts = [part.strip().rstrip("%").strip() for part in text.replace(";", ",").split(",") if part.strip()]
    if len(parts) > MAX_THRESHOLDS:
        raise AlertSettingsError(f"Give at most {MAX_THRESHOLDS} thresholds.")
    try:
        values = sorted({int(part) for part in parts})
    except ValueError:
        raise AlertSettingsError("Thresholds are whole percents separated by commas, such as '80, 100'.") from None
    if any(not 1 <= value <= 100 for value in values):
        raise AlertSettingsError("Each threshold is a percent of the daily quota from 1 to 100.")
    return tuple(values)


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(24)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value: ``t=<timestamp>,v1=<hex HMAC-SHA256 of "<timestamp>.<body>">``."""
    digest = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


Resolver = Callable[[str], Awaitable[list[str]]]


async def check_webhook_url(url: str, settings: GatewaySettings, resolver: Resolver = system_resolver) -> str | None:
    """Refuse a webhook URL Flatfare must not post to: not https (unless the operator allows http), or a
    host that is, or resolves to, a private, loopback, link-local or otherwise non-public address (unless
    the operator exempts it). Returns the vetted address to connect to for a name (None: the URL's host is
    an address itself, or exempt)."""
    ref = media.MediaRef("webhook_url", "webhook", url)
    scheme = url.partition(":")[0].lower()
    if scheme != "https" and not (scheme == "http" and settings.quota_alerts_webhook_allow_http):
        raise AlertSettingsError("The webhook URL must start with https://.")
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        raise AlertSettingsError("The webhook URL is not a valid URL.") from None
    if host and host in settings.quota_alerts_webhook_allow_hosts:
        return None
    try:
        name = media.host_of(ref)
    except APIError as exc:
        raise AlertSettingsError("The webhook URL is refused: " + exc.message.removeprefix("webhook_url: ")) from None
    if name is None:
        return None
    try:
        addresses = await asyncio.wait_for(resolver(name), 2.0)
    except (TimeoutError, OSError):
        raise AlertSettingsError(f"The webhook URL's host '{name}' does not resolve.") from None
    for address in addresses:
        try:
            parsed = ipaddress.ip_address(address)
        except ValueError:
            raise AlertSettingsError(f"The webhook URL's host '{name}' resolves to '{address}', "
                                     "not an address.") from None
        if media.forbidden(parsed):
            raise AlertSettingsError(f"The webhook URL is refused: its host resolves to {address}, which is not "
                                     "a public address.")
    if not addresses:
        raise AlertSettingsError(f"The webhook URL's host '{name}' does not resolve.")
    return addresses[0]


def pinned(url: str, address: str | None) -> tuple[str, dict[str, str], dict[str, str]]:
    """The URL, extra headers and request extensions that reach ``url`` at ``address``: the address in the
    URL, the name in the Host header and in TLS (SNI and the certificate check). ``url`` as is without one."""
    if address is None:
        return url, {}, {}
    parts = urlsplit(url)
    host = parts.hostname or ""
    shown = f"[{address}]" if ":" in address else address
    netloc = f"{shown}:{parts.port}" if parts.port else shown
    return (parts._replace(netloc=netloc).geturl(), {"Host": parts.netloc},
            {"sni_hostname": host} if parts.scheme.lower() == "https" else {})


async def save_rules(session: AsyncSession, account_id: int, rules: AlertRules, *,
                     roll_secret: bool = False) -> QuotaAlertSettings:
    """Store an account's alerts (already checked) in the caller's transaction; a webhook gets a secret
    the first time (and a new one when asked)."""
    row = await session.get(QuotaAlertSettings, account_id, with_for_update=True)
    if row is None:
        row = QuotaAlertSettings(account_id=account_id)
        session.add(row)
    row.thresholds = list(rules.thresholds)
    row.email_enabled = rules.email
    row.webhook_url = rules.webhook_url
    if rules.webhook_url and (row.webhook_secret is None or roll_secret):
        row.webhook_secret = new_secret()
    row.updated_at = datetime.now(UTC)
    return row


def event_body(delivery: QuotaAlertDelivery, created: int) -> bytes:
    return json.dumps({
        "id": f"qa_{delivery.id}", "type": EVENT_TYPE, "created": created,
        "data": {"account_id": delivery.account_id, "quota_day": delivery.quota_day,
                 "threshold_percent": delivery.threshold, "used": delivery.used,
                 "daily_limit": delivery.daily_limit}}, separators=(",", ":")).encode()


class QuotaAlerts:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], quota: DailyQuota, plans: PlanBook,
                 settings: GatewaySettings, http: httpx.AsyncClient | None = None,
                 resolver: Resolver = system_resolver) -> None:
        self._sessions = sessions
        self._quota = quota
        self._plans = plans
        self._settings = settings
        self._http = http
        self._resolver = resolver

    async def record_crossings(self, now: datetime | None = None) -> int:
        """Insert a pending delivery for every threshold an account's day has crossed and every channel it
        alerts by, unless one is recorded already; returns how many rows this call inserted."""
        now = now or datetime.now(UTC)
        async with self._sessions() as session:
            rows = (await session.execute(
                select(Account, QuotaAlertSettings)
                .outerjoin(QuotaAlertSettings, QuotaAlertSettings.account_id == Account.id)
                .where(or_(QuotaAlertSettings.account_id.is_(None), QuotaAlertSettings.email_enabled,
                           QuotaAlertSettings.webhook_url.is_not(None))))).all()
        watched: dict[int, tuple[AlertRules, int, str]] = {}
        for account, row in rows:
            rules = AlertRules.of(row)
            terms = await self._plans.terms(account, now)
            if rules.thresholds and rules.channels() and terms.daily_limit:
                watched[account.id] = (rules, terms.daily_limit, quota_window(terms.plan.timezone, now).day)
        used = await self._quota.used_by_accounts({account_id: day for account_id, (_, _, day) in watched.items()})
        wanted: list[dict[str, object]] = []
        for account_id, (rules, limit, day) in watched.items():
            count = used.get(account_id, 0)
            for threshold in rules.thresholds:
                if count * 100 >= threshold * limit:
                    wanted += [{"account_id": account_id, "quota_day": day, "threshold": threshold,
                                "channel": channel.value, "used": count, "daily_limit": limit,
                                "status": AlertStatus.PENDING.value, "attempts": 0, "next_attempt_at": now,
                                "created_at": now} for channel in rules.channels()]
        if not wanted:
            return 0
        async with self._sessions() as session, session.begin():
            days = sorted({str(row["quota_day"]) for row in wanted})
            known = {tuple(row) for row in await session.execute(
                select(QuotaAlertDelivery.account_id, QuotaAlertDelivery.quota_day, QuotaAlertDelivery.threshold,
                       QuotaAlertDelivery.channel).where(QuotaAlertDelivery.quota_day.in_(days)))}
            new = [row for row in wanted
                   if (row["account_id"], row["quota_day"], row["threshold"], row["channel"]) not in known]
            if not new:
                return 0
            insert = postgresql_insert if session.bind.dialect.name == "postgresql" else sqlite_insert
            result = await session.execute(insert(QuotaAlertDelivery).values(new).on_conflict_do_nothing())
        return max(result.rowcount or 0, 0)

    async def send_due(self, now: datetime | None = None,
                       holding: Callable[[], Awaitable[bool]] | None = None) -> int:
        """Try every delivery that is due; returns how many were sent."""
        now = now or datetime.now(UTC)
        async with self._sessions() as session:
            due = list(await session.scalars(
                select(QuotaAlertDelivery).where(QuotaAlertDelivery.status == AlertStatus.PENDING.value,
                                                 QuotaAlertDelivery.next_attempt_at <= now)
                .order_by(QuotaAlertDelivery.next_attempt_at).limit(BATCH)))
        sent = 0
        for delivery in due:
            if holding is not None and not await holding():
                break
            sent += await self._try(delivery)
        return sent

    async def _try(self, delivery: QuotaAlertDelivery) -> int:
        now = datetime.now(UTC)
        attempts = delivery.attempts + 1
        async with self._sessions() as session, session.begin():
            # The claim: only one process's update matches this row's attempts.
            claimed = await session.execute(update(QuotaAlertDelivery).where(
                QuotaAlertDelivery.id == delivery.id, QuotaAlertDelivery.status == AlertStatus.PENDING.value,
                QuotaAlertDelivery.attempts == delivery.attempts)
                .values(attempts=attempts, next_attempt_at=now + timedelta(seconds=CLAIM_S)))
            if claimed.rowcount != 1:
                return 0
            rules = AlertRules.of(await session.get(QuotaAlertSettings, delivery.account_id))
            emails = (await member_emails(session, delivery.account_id, roles_with(Area.USAGE))
                      if delivery.channel == AlertChannel.EMAIL else [])
        values: dict[str, object]
        try:
            if delivery.channel == AlertChannel.EMAIL:
                await self._email(delivery, rules, emails)
            else:
                await self._post(delivery, rules)
            # last_error stays: the log shows why earlier tries failed.
            values = {"status": AlertStatus.SENT.value, "sent_at": datetime.now(UTC)}
        except DeliveryError as exc:
            failed = isinstance(exc, NothingToDeliver) or attempts >= self._settings.quota_alerts_max_attempts
            log.warning("quota alert %s (%s) failed, try %d: %s", delivery.id, delivery.channel, attempts, exc)
            values = {"last_error": str(exc)[:500],
                      "next_attempt_at": now + backoff(attempts, self._settings.quota_alerts_max_backoff_s)}
            if failed:
                values["status"] = AlertStatus.FAILED.value
        async with self._sessions() as session, session.begin():
            await session.execute(update(QuotaAlertDelivery).where(QuotaAlertDelivery.id == delivery.id)
                                  .values(**values))
        return int(values.get("status") == AlertStatus.SENT.value)

    async def _email(self, delivery: QuotaAlertDelivery, rules: AlertRules, emails: list[str]) -> None:
        if not rules.email:
            raise NothingToDeliver("email alerts were turned off")
        if not emails:
            raise NothingToDeliver("the account has no console user to email")
        # Imported here: the console package (its alerts page) imports this module.
        from flatfare.gateway.console.mail import MailError, Mailer

        mailer = Mailer(self._settings)
        public = self._settings.public_url
        text = (f"Your Flatfare account has made {delivery.used} of its {delivery.daily_limit} requests for quota "
                f"day {delivery.quota_day}, past your {delivery.threshold} % alert. At 100 % further requests are "
                f"refused (429) until the day resets. Usage: {public}/console/usage . Plans: {public}/console/billing"
                f" . Alerts: {public}/console/alerts")
        try:
            for email in emails:
                await mailer.send(email, SUBJECT.format(threshold=delivery.threshold), text, raise_errors=True)
        except MailError as exc:
            raise DeliveryError(str(exc)) from exc

    async def _post(self, delivery: QuotaAlertDelivery, rules: AlertRules) -> None:
        if not rules.webhook_url or not rules.webhook_secret:
            raise NothingToDeliver("the webhook was removed")
        try:  # again before each try: the name may resolve elsewhere by now
            address = await check_webhook_url(rules.webhook_url, self._settings, self._resolver)
        except AlertSettingsError as exc:
            raise DeliveryError(str(exc)) from exc
        created = int(datetime.now(UTC).timestamp())
        body = event_body(delivery, created)
        url, host, tls = pinned(rules.webhook_url, address)
        headers = {"Content-Type": "application/json", "User-Agent": "Flatfare-Webhooks/1",
                   SIGNATURE_HEADER: sign(rules.webhook_secret, created, body), "Flatfare-Delivery": str(delivery.id),
                   **host}
        client = self._http or httpx.AsyncClient()
        try:
            answer = await client.post(url, content=body, headers=headers, timeout=WEBHOOK_TIMEOUT_S,
                                       follow_redirects=False, extensions=tls)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"could not reach the webhook: {exc.__class__.__name__}") from exc
        finally:
            if self._http is None:
                await client.aclose()
        if not 200 <= answer.status_code < 300:
            raise DeliveryError(f"the webhook answered HTTP {answer.status_code}")

    async def run(self, redis: aioredis.Redis, stop: asyncio.Event) -> None:
        """A pass every ``FLATFARE_QUOTA_ALERTS_EVERY_S``, in one process at a time (a lease in Redis)."""
        every_s = self._settings.quota_alerts_every_s
        # Outlives a webhook's timeout twice over: renewed before each try, it cannot lapse during one.
        lease = Lease(redis, QUOTA_ALERTS_LEADER_KEY, max(int(every_s * 10), 5, math.ceil(2 * WEBHOOK_TIMEOUT_S)))
        while not stop.is_set():
            try:
                if await lease.hold():
                    await self.record_crossings()
                    await self.send_due(holding=lease.renew)
            except Exception:  # noqa: BLE001 - the loop must outlive a database or Redis hiccup
                log.exception("quota alert pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
