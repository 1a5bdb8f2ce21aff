"""The money audit (bench/audit.py) reports each fault it exists for. A few requests go through the
real ledger, quota and outbox into the books of a fault rig (bench.faults.Rig.start_books: a SQLite
ledger, a private Redis, Stripe's edge); the clean books pass, then one fault at a time is planted
and must show in the audit's numbers. No load, no engine: seconds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench.audit import Audit
from bench.faults import PRICE_MICROS, Rig
from bench.procs import Services
from flatfare.billing.ledger import Charge, Ledger, Outcome
from flatfare.billing.outbox import OutboxSender
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import DailyQuota, expiry
from flatfare.billing.stripe_client import StripeConfig, StripeGateway
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue, QuotaClaim
from flatfare.redis_conn import connect
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import RequestStatus

pytestmark = pytest.mark.faults

BILLED = ["req-billed-1", "req-billed-2", "req-billed-3"]
FREE = "req-free-1"


@dataclass
class Books:
    """The rig's books and the real parts that write them, as a gateway process holds them."""

    rig: Rig
    sessions: async_sessionmaker[AsyncSession]
    redis: aioredis.Redis
    ledger: Ledger
    quota: DailyQuota
    queue: LaneQueue
    stripe: StripeGateway
    key_id: int
    day: str
    resets_at: datetime

    @property
    def unit(self) -> str:
        return f"{self.rig.account_id}:{self.day}"

    async def request(self, request_id: str, *, billable: bool, give_back: bool = True) -> None:
        """One request from admission to settlement, as a gateway process takes it: the admission
        script counts and holds its unit and queues its job; its row is opened and closed; a billable
        one releases its unit, a free one gives it back (unless ``give_back`` is False: the fault of a
        lost give-back)."""
        job = Job(request_id=request_id, endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0)
        admitted = await self.queue.admit(job, self.rig.model, QuotaClaim(self.rig.account_id, self.day, None,
                                                                           expiry(self.resets_at)))
        await self.ledger.open(request_id=request_id, account_id=self.rig.account_id, api_key_id=self.key_id,
                               model=self.rig.model, endpoint="chat", stream=False, created_at=datetime.now(UTC),
                               charge=Charge(plan="pro", price_micros=PRICE_MICROS, quota_day=self.day))
        if billable:
            await self.ledger.close(request_id, Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=8))
            await self.redis.hdel(self.queue.holder, request_id)
        else:
            await self.ledger.close(request_id, Outcome(RequestStatus.FAILED, 502, error_code="worker_lost",
                                                        billable=False))
            if give_back:
                assert await self.quota.give_back(self.rig.account_id, self.day, request_id, self.queue.holder,
                                                  admitted.generation)

    async def send_outbox(self) -> None:
        await OutboxSender(self.sessions, self.stripe).send_due()

    async def meter_event(self, identifier: str, idempotency_key: str) -> httpx.Response:
        """A meter event sent straight to Stripe's edge, as a sender other than the outbox would."""
        assert self.rig.edge is not None
        async with httpx.AsyncClient() as client:
            return await client.post(
                f"{self.rig.edge.url}/v1/billing/meter_events", headers={"Idempotency-Key": idempotency_key},
                data={"event_name": "flatfare_requests", "identifier": identifier, "timestamp": "0",
                      "payload[stripe_customer_id]": "cus_faults", "payload[value]": "1"})


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(tmp_path, Services()).start_books()
    yield rig
    rig.stop()


@pytest.fixture
async def books(rig: Rig) -> AsyncIterator[Books]:
    """Three billable requests and one free one, settled, their meter events sent: clean books."""
    assert rig.redis is not None and rig.edge is not None
    engine = create_engine(rig.database_url, pool_size=2)
    redis = connect(rig.redis.url)
    ledger = Ledger(session_factory(engine))
    window = quota_window("UTC", datetime.now(UTC))
    key_id = rig.sql("SELECT id FROM api_keys WHERE account_id = :a", a=rig.account_id)[0][0]
    stripe = StripeGateway(StripeConfig(api_key="sk_test_faults", webhook_secret="whsec_faults",
                                        api_base=rig.edge.url, timeout_s=10))
    quota = DailyQuota(redis, ledger.billable_counts)
    queue = LaneQueue(redis, {lane: LaneLimits(1000, 60.0) for lane in Lane}, quota)
    books = Books(rig, session_factory(engine), redis, ledger, quota, queue, stripe, key_id, window.day,
                  window.resets_at)
    for request_id in BILLED:
        await books.request(request_id, billable=True)
    await books.request(FREE, billable=False)
    await books.send_outbox()
    try:
        yield books
    finally:
        ledger.dispose()
        await redis.aclose()
        await engine.dispose()


def _faults(audit: Audit) -> str:
    return "; ".join(audit.faults()) or "none"


async def test_clean_books_pass(books: Books) -> None:
    audit = books.rig.audit()
    assert audit.clean, _faults(audit)
    assert audit.faults() == []
    assert (audit.billable, audit.given_back, audit.counted, audit.outbox_sent, audit.stripe_events) == (3, 1, 3, 3, 3)
    assert (audit.billed_twice, audit.sent_twice, audit.stripe_missing, audit.stripe_extra, audit.unaccounted) == (
        [], {}, [], [], {})


async def test_a_second_billable_row_for_a_request_id_is_billed_twice(books: Books) -> None:
    # The ledger's primary key forbids it: plant it in a ledger that lost its key (a bad migration).
    for statement in ("CREATE TABLE requests_unkeyed AS SELECT * FROM requests", "DROP TABLE requests",
                      "ALTER TABLE requests_unkeyed RENAME TO requests",
                      "INSERT INTO requests SELECT * FROM requests WHERE id = :id"):
        books.rig.sql(statement, id=BILLED[0])
    audit = books.rig.audit()
    assert audit.billed_twice == [BILLED[0]]
    assert audit.charged_twice == 1 and not audit.clean
    assert audit.unaccounted == {books.unit: -1}  # two billable rows, one unit counted


async def test_a_meter_event_sent_again_under_another_key_is_sent_twice(books: Books) -> None:
    answer = await books.meter_event(BILLED[0], "a-second-sender")
    assert answer.status_code == 400  # Stripe refuses it and keeps one event...
    audit = books.rig.audit()
    assert audit.stripe_events == 3
    assert audit.sent_twice == {BILLED[0]: 1}  # ...but it was sent twice, and the audit says so
    assert audit.charged_twice == 1 and not audit.clean


async def test_a_retry_under_the_same_key_is_a_replay_not_a_second_charge(books: Books) -> None:
    # The outbox sending a row again (a crash between sending and marking it sent) bills nothing new.
    await books.stripe.send_meter_event(customer_id="cus_faults", identifier=BILLED[0], timestamp=0)
    audit = books.rig.audit()
    assert audit.stripe_replays == 1
    assert audit.clean, _faults(audit)


async def test_a_lost_give_back_is_a_unit_unaccounted(books: Books) -> None:
    await books.request("req-free-2", billable=False, give_back=False)
    audit = books.rig.audit()
    assert audit.unaccounted == {books.unit: 1}  # counted, neither billable nor given back
    assert (audit.counted, audit.billable) == (4, 3) and not audit.clean


async def test_a_meter_event_for_a_request_not_billable_is_extra(books: Books) -> None:
    await books.stripe.send_meter_event(customer_id="cus_faults", identifier=FREE, timestamp=0)
    audit = books.rig.audit()
    assert audit.stripe_extra == [FREE]
    assert audit.stripe_events == 4 and not audit.clean


async def test_a_billable_request_stripe_never_got_is_missing(books: Books) -> None:
    await books.request("req-billed-4", billable=True)  # its outbox row is never sent
    audit = books.rig.audit()
    assert audit.stripe_missing == ["req-billed-4"]
    assert not audit.clean
