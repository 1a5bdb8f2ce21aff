"""The meter-event outbox against real SQL and Redis, with Stripe's network answered at its edge
(bench.stripe_edge: a local HTTP server that keeps one meter event per identifier, as Stripe does):
due rows go out once each, as the request's id; a failure backs off; reconciliation puts back what
the outbox lost; and only the holder of the Redis lease sends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench.stripe_edge import StripeEdge
from flatfare.billing.ledger import Charge, Ledger, Outcome
from flatfare.billing import outbox
from flatfare.billing.outbox import LEADER_KEY, OutboxSender, reconcile
from flatfare.billing.stripe_client import StripeConfig, StripeGateway
from flatfare.storage.models import Meter, RequestStatus, UsageOutbox
from flatfare.tracing import Tracer, traces_url
from tests.billing.conftest import account_with_key
from tests.otlp_receiver import otlp_receiver

DAY = "2026-12-03"
CHARGE = Charge(plan="pro", price_micros=2000, quota_day=DAY)
CUSTOMER = "cus_outbox"


@pytest.fixture
def edge() -> Iterator[StripeEdge]:
    server = StripeEdge().start()
    yield server
    server.stop()


def _gateway(edge: StripeEdge, timeout_s: float = 20.0) -> StripeGateway:
    return StripeGateway(StripeConfig(api_key="sk_test_outbox", webhook_secret="whsec_outbox", api_base=edge.url,
                                      timeout_s=timeout_s))


@pytest.fixture
async def ledger(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[Ledger]:
    writer = Ledger(sessions)
    yield writer
    writer.dispose()


async def _billed(ledger: Ledger, sessions: async_sessionmaker[AsyncSession], ids: list[str],
                  customer: str | None = CUSTOMER, account: str = "acme") -> None:
    """Requests of a priced plan that ended billable: the ledger writes their outbox rows."""
    issued = await account_with_key(sessions, account, stripe_customer_id=customer)
    for request_id in ids:
        await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id,
                          model="m", endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=CHARGE)
        await ledger.close(request_id, Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=3))


async def _rows(sessions: async_sessionmaker[AsyncSession]) -> dict[str, UsageOutbox]:
    async with sessions() as session:
        return {row.request_id: row for row in await session.scalars(select(UsageOutbox))}


def _later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


async def test_due_rows_are_sent_once_each_as_their_request_id(sessions, ledger, edge) -> None:
    await _billed(ledger, sessions, ["r1", "r2", "r3"])
    await _billed(ledger, sessions, ["free-1"], customer=None, account="not-on-stripe")
    async with sessions() as session, session.begin():  # one row is not due yet
        await session.execute(update(UsageOutbox).where(UsageOutbox.request_id == "r3")
                              .values(next_attempt_at=_later(60)))
    sender = OutboxSender(sessions, _gateway(edge))

    assert await sender.send_due() == 2
    assert sorted(e["identifier"] for e in edge.meter_events) == ["r1", "r2"]
    event = edge.meter_events[0]
    assert (event["event_name"], event["payload[stripe_customer_id]"], event["payload[value]"]) == (
        "flatfare_requests", CUSTOMER, "1")
    rows = await _rows(sessions)
    assert int(event["timestamp"]) == int(rows[event["identifier"]].created_at.timestamp())
    assert [(rows[r].status, rows[r].attempts) for r in ("r1", "r2", "r3")] == [("sent", 1), ("sent", 1),
                                                                             ("pending", 0)]
    assert rows["r1"].sent_at is not None
    # An account that is not billed through Stripe: its row is settled without a call.
    assert (rows["free-1"].status, rows["free-1"].last_error) == ("skipped", "account has no Stripe customer")

    # Sent rows are never sent again; the late one goes out once it is due.
    assert await sender.send_due() == 0
    assert await sender.send_due(now=_later(120)) == 1
    assert sorted(edge.deliveries.items()) == [("r1", 1), ("r2", 1), ("r3", 1)]


async def test_a_refused_call_backs_off_and_is_tried_again(sessions, ledger, edge) -> None:
    await _billed(ledger, sessions, ["r1"])
    sender = OutboxSender(sessions, _gateway(edge))
    edge.fail_meter_events = 2  # Stripe answers 500 twice
    now = datetime.now(UTC)

    assert await sender.send_due(now) == 0
    row = (await _rows(sessions))["r1"]
    assert (row.status, row.attempts, row.next_attempt_at) == ("pending", 1, now + timedelta(seconds=1))
    assert row.last_error and row.last_error.startswith("Stripe:")
    assert await sender.send_due(now) == 0  # not due again until its backoff has passed
    assert edge.deliveries["r1"] == 1

    assert await sender.send_due(now + timedelta(seconds=1)) == 0
    row = (await _rows(sessions))["r1"]
    assert (row.attempts, row.next_attempt_at) == (2, now + timedelta(seconds=3))  # the wait doubled

    assert await sender.send_due(now + timedelta(seconds=3)) == 1
    row = (await _rows(sessions))["r1"]
    assert (row.status, row.attempts, edge.deliveries["r1"]) == ("sent", 3, 3)
    assert [e["identifier"] for e in edge.meter_events] == ["r1"]


class _Overlap(StripeGateway):
    """The gateway, counting the meter-event calls in flight at once."""

    in_flight = most = 0

    async def send_meter_event(self, **event) -> None:  # noqa: ANN003 - StripeGateway's keywords
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await super().send_meter_event(**event)
        finally:
            self.in_flight -= 1


async def test_calls_overlap_and_each_group_is_marked_at_once(sessions, ledger, edge, monkeypatch) -> None:
    """One call at a time, a sender beside the traffic fell behind it (the soak): a pass sends
    ``CONCURRENCY`` at once and marks each group's rows in one transaction."""
    ids = [f"r{i}" for i in range(outbox.CONCURRENCY + 3)]
    await _billed(ledger, sessions, ids)
    stripe = _Overlap(_gateway(edge).config)
    commits = 0
    real_commit = AsyncSession.commit

    async def counted(self: AsyncSession) -> None:
        nonlocal commits
        commits += 1
        await real_commit(self)

    monkeypatch.setattr(AsyncSession, "commit", counted)
    assert await OutboxSender(sessions, stripe).send_due() == len(ids)
    assert stripe.most == outbox.CONCURRENCY
    assert commits == 2  # a group of CONCURRENCY, then the last 3
    assert sorted(e["identifier"] for e in edge.meter_events) == sorted(ids)
    assert {row.status for row in (await _rows(sessions)).values()} == {"sent"}


async def test_each_send_is_a_span_naming_the_request_it_bills(sessions, ledger, edge) -> None:
    """With tracing on, every send (a failed one too) is a span of its own trace, to a real OTLP receiver:
    the outbox row keeps no trace, so flatfare.request_id is what joins it to its request's."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    await _billed(ledger, sessions, ["r1", "r2"])
    edge.fail_meter_events = 1
    with otlp_receiver() as receiver:
        tracer = Tracer("flatfare-gateway", OTLPSpanExporter(endpoint=traces_url(receiver.url)), ratio=1.0)
        sender = OutboxSender(sessions, _gateway(edge), tracer=tracer)
        now = datetime.now(UTC)
        try:
            assert await sender.send_due(now) == 1
            assert await sender.send_due(now + timedelta(seconds=1)) == 1
        finally:
            tracer.shutdown()  # exports what waits
        sends = [s for s in receiver.spans if s.name == "outbox send"]
    tries: dict[str, list[bool]] = {}  # each request's sends, in order: the one Stripe refused first, tried again
    for span in sorted(sends, key=lambda s: s.attributes["flatfare.attempt"]):
        tries.setdefault(span.attributes["flatfare.request_id"], []).append(span.attributes["flatfare.sent"])
    assert sorted(tries) == ["r1", "r2"] and sorted(tries.values()) == [[False, True], [True]]
    assert len({s.trace_id for s in sends}) == 3 and all(s.parent_id == "" for s in sends)


async def test_the_backoff_is_capped(sessions, ledger, edge) -> None:
    await _billed(ledger, sessions, ["r1"])
    sender = OutboxSender(sessions, _gateway(edge), max_backoff_s=5)
    async with sessions() as session, session.begin():  # many failures already
        await session.execute(update(UsageOutbox).values(attempts=20))
    edge.fail_meter_events = 1
    now = datetime.now(UTC)
    assert await sender.send_due(now) == 0
    assert (await _rows(sessions))["r1"].next_attempt_at == now + timedelta(seconds=5)


async def test_an_answer_lost_after_stripe_recorded_the_event_bills_it_once(sessions, ledger, edge) -> None:
    """Stripe records the event but its answer never arrives (the call times out): the retry gets the
    first call's answer (same Idempotency-Key) instead of a duplicate's refusal, and the row is sent."""
    await _billed(ledger, sessions, ["r1"])
    sender = OutboxSender(sessions, _gateway(edge, timeout_s=1.0))
    edge.lost_answer_rate, edge.hold_s = 1.0, 3.0
    now = datetime.now(UTC)
    assert await sender.send_due(now) == 0
    assert [e["identifier"] for e in edge.meter_events] == ["r1"]  # Stripe has it; the sender does not know
    assert (await _rows(sessions))["r1"].status == "pending"

    edge.lost_answer_rate = 0.0
    assert await sender.send_due(now + timedelta(seconds=1)) == 1
    row = (await _rows(sessions))["r1"]
    assert (row.status, row.attempts, edge.deliveries["r1"]) == ("sent", 2, 2)
    assert len(edge.meter_events) == 1


async def test_reconcile_requeues_billable_rows_missing_from_the_outbox(sessions, ledger, edge) -> None:
    await _billed(ledger, sessions, ["r1", "r2", "r3"])
    issued = await account_with_key(sessions, "other", stripe_customer_id="cus_other")
    # Not billable: failed before the first token; still running (queued); another day; a free plan.
    await ledger.open(request_id="failed", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=CHARGE)
    await ledger.close("failed", Outcome(RequestStatus.FAILED, 500, billable=False))
    await ledger.open(request_id="running", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=CHARGE)
    for request_id, charge in (("yesterday", Charge("pro", 2000, "2026-12-02")), ("free", Charge("free", 0, DAY))):
        await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id,
                          model="m", endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=charge)
        await ledger.close(request_id, Outcome(RequestStatus.SUCCEEDED, 200))
    async with sessions() as session, session.begin():  # rows lost from the outbox, one of them sent
        await session.execute(update(UsageOutbox).where(UsageOutbox.request_id == "r1").values(status="sent"))
        await session.execute(delete(UsageOutbox).where(UsageOutbox.request_id.in_(["r2", "yesterday"])))

    report = await reconcile(sessions, DAY)
    assert (report.day, report.billable, report.in_outbox, report.sent, report.repaired) == (DAY, 3, 3, 1, 1)
    rows = await _rows(sessions)
    assert set(rows) == {"r1", "r2", "r3"}  # another day's row is that day's reconciliation's
    assert (rows["r2"].status, rows["r2"].attempts, rows["r2"].day) == ("pending", 0, DAY)
    again = await reconcile(sessions, DAY)
    assert again.repaired == 0 and again.in_outbox == 3

    # The row put back is sent like any other.
    assert await OutboxSender(sessions, _gateway(edge)).send_due(_later(1)) == 2
    assert sorted(e["identifier"] for e in edge.meter_events) == ["r2", "r3"]


async def _wait_for(predicate, timeout_s: float = 20.0) -> None:  # noqa: ANN001 - test helper
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_only_the_lease_holder_sends(sessions, ledger, edge, redis) -> None:
    await _billed(ledger, sessions, ["r1", "r2"])
    await redis.set(LEADER_KEY, b"another-gateway", ex=60)  # another process holds the lease
    stop = asyncio.Event()
    # A 2 s Stripe timeout: the lease is the 5 s floor (it covers two of the slowest calls).
    runner = asyncio.create_task(OutboxSender(sessions, _gateway(edge, timeout_s=2.0)).run(redis, stop,
                                                                                           interval_s=0.05))
    try:
        await asyncio.sleep(1.0)  # about twenty passes, none of them the holder's
        assert edge.deliveries == {} and {r.status for r in (await _rows(sessions)).values()} == {"pending"}
        assert await redis.get(LEADER_KEY) == b"another-gateway"

        await redis.pexpire(LEADER_KEY, 1)  # its holder died: the lease runs out and this one takes it

        async def all_sent() -> bool:
            return {r.status for r in (await _rows(sessions)).values()} == {"sent"}

        await _wait_for(all_sent)
        holder = await redis.get(LEADER_KEY)
        assert holder not in (None, b"another-gateway")
        # The holder renews its lease on every pass (to at most 5 s here, so it lapses soon after a death).
        await redis.expire(LEADER_KEY, 1000)

        async def renewed() -> bool:
            return 0 < await redis.ttl(LEADER_KEY) <= 5

        await _wait_for(renewed)
        assert await redis.get(LEADER_KEY) == holder
    finally:
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runner, 10)
    assert sorted(e["identifier"] for e in edge.meter_events) == ["r1", "r2"]


async def test_the_lease_outlives_the_slowest_stripe_call(sessions, edge, redis) -> None:
    """A lease shorter than one Stripe call would lapse while the holder waits on it, and let a second
    process send the same rows: the lease covers two of the slowest calls."""
    stop = asyncio.Event()
    runner = asyncio.create_task(OutboxSender(sessions, _gateway(edge, timeout_s=20.0)).run(redis, stop,
                                                                                            interval_s=0.05))
    try:
        async def leased() -> bool:
            return await redis.get(LEADER_KEY) is not None

        await _wait_for(leased)
        assert await redis.ttl(LEADER_KEY) > 20
    finally:
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runner, 10)


async def test_batch_lines_go_to_the_batch_meter_and_reconcile_puts_them_back_there(sessions, ledger, edge) -> None:
    """A Batch API line (ledger endpoint ``batch:...``) is priced at the batch discount, so it goes to a meter
    of its own (``flatfare_batch_requests``), never the requests meter; a lost row comes back on it."""
    issued = await account_with_key(sessions, "acme", stripe_customer_id=CUSTOMER)
    for request_id, endpoint in (("live-1", "chat"), ("batch_x-0", "batch:chat"), ("batch_x-1", "batch:chat")):
        await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                          endpoint=endpoint, stream=False, created_at=datetime.now(UTC), charge=CHARGE)
        await ledger.close(request_id, Outcome(RequestStatus.SUCCEEDED, 200))
    async with sessions() as session, session.begin():
        # The collector writes batch lines' rows on the batch meter; one of them is lost.
        await session.execute(update(UsageOutbox).where(UsageOutbox.request_id == "batch_x-0")
                              .values(meter=Meter.BATCH.value))
        await session.execute(delete(UsageOutbox).where(UsageOutbox.request_id == "batch_x-1"))
    assert (await reconcile(sessions, DAY)).repaired == 1
    assert {r: row.meter for r, row in (await _rows(sessions)).items()} == {
        "live-1": "requests", "batch_x-0": "batch_requests", "batch_x-1": "batch_requests"}

    assert await OutboxSender(sessions, _gateway(edge)).send_due(_later(1)) == 3
    assert sorted((e["identifier"], e["event_name"]) for e in edge.meter_events) == [
        ("batch_x-0", "flatfare_batch_requests"), ("batch_x-1", "flatfare_batch_requests"),
        ("live-1", "flatfare_requests")]
