"""The money audit: every charging guarantee, checked from what each party recorded, as numbers that
turn non-zero when the guarantee breaks. It reads the SQL ledger (``requests``, ``usage_outbox``),
Redis's quota counters and every meter-event call Stripe's edge received (bench.stripe_edge);
the fault benchmark (bench/faults.py) reports it and tests/faults asserts on it.

(a) **Billed twice**: request ids with more than one billable ledger row. The table's primary key
    forbids them; the audit counts the rows it reads and does not rely on the key.
(b) **Stripe**: the identifiers Stripe kept must be the billable requests of priced plans billed
    through Stripe, no more (``stripe_extra``: a meter event sent for a request that is not
    billable) and no fewer (``stripe_missing``). A meter event sent again for an identifier Stripe
    already kept, under another Idempotency-Key, is **sent twice** (``sent_twice``): Stripe refuses
    it with a 400, so it never shows among the events Stripe kept, and only the edge's record of
    every call can count it. A retry under the same key gets Stripe's first answer again and bills
    nothing new (``stripe_replays``): expected only after an answer was lost.
(c) **Quota units**: a day's counter in Redis is the units counted that day minus the units given
    back (a request that fails before its first token gives its unit back: its ledger row closes not
    billable). Units counted = billable rows + units given back therefore holds when each account's
    counter equals its billable rows for the day; ``unaccounted`` holds the difference where it does
    not: one over per unit counted with neither a billable row nor a give-back (a lost give-back),
    one under per unit given back twice.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis as redis_py
from sqlalchemy import create_engine, text

from bench.stripe_edge import Answer, MeterCall
from flatfare import contract
from flatfare.billing.ledger import BATCH_ENDPOINT_PREFIX

# The quota's counters (contract.quota_counter_key), not its epoch marker or rebuild lock.
_COUNTERS = contract.quota_counter_key("*", "*")
_COUNTER = re.compile("^" + re.escape(contract.quota_counter_key("ACCOUNT", "DAY"))
                      .replace("ACCOUNT", r"(\d+)").replace("DAY", r"(\d{4}-\d{2}-\d{2})") + "$")


@dataclass(frozen=True, slots=True)
class LedgerRow:
    request_id: str
    account_id: int
    quota_day: str | None
    billable: bool
    open: bool  # still queued: the request has not ended
    priced: bool  # its plan's price is above zero
    on_stripe: bool  # its account is billed through Stripe (has a customer)
    batch: bool = False  # a Batch API line's row: counted on the plan's batch allowance, not its daily quota


@dataclass(frozen=True, slots=True)
class Books:
    """What every party recorded, read at one moment."""

    ledger: list[LedgerRow]
    outbox: dict[str, str]  # request id -> status
    counters: dict[tuple[int, str], int]  # (account id, day) -> units in Redis
    received: list[MeterCall]


def sync_url(database_url: str) -> str:
    """The platform's (asyncio) database URL through a synchronous driver."""
    return (database_url.replace("sqlite+aiosqlite", "sqlite").replace("postgresql+asyncpg://", "postgresql+psycopg://")
            .replace("postgresql://", "postgresql+psycopg://"))


def read_books(database_url: str, redis_url: str, received: Iterable[MeterCall]) -> Books:
    received = list(received)  # the edge appends from its own thread
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            ledger = [LedgerRow(str(rid), int(account), day, bool(billable), status == "queued", int(price) > 0,
                                customer is not None, str(endpoint).startswith(BATCH_ENDPOINT_PREFIX))
                      for rid, account, day, billable, status, price, customer, endpoint in conn.execute(text(
                          "SELECT r.id, r.account_id, r.quota_day, r.billable, r.status, r.price_micros, "
                          "a.stripe_customer_id, r.endpoint FROM requests r JOIN accounts a ON a.id = r.account_id"))]
            outbox = {str(rid): str(status) for rid, status in
                      conn.execute(text("SELECT request_id, status FROM usage_outbox"))}
    finally:
        engine.dispose()
    client = redis_py.Redis.from_url(redis_url)
    try:
        counters = {}
        for key in client.scan_iter(match=_COUNTERS):
            found = _COUNTER.match(key.decode())
            if found:
                counters[(int(found[1]), found[2])] = int(client.get(key) or 0)
    finally:
        client.close()
    return Books(ledger, outbox, counters, received)


@dataclass
class Audit:
    rows: int
    open_rows: int
    billed: int  # billable rows of priced plans, live and batch: each has one outbox row and one meter event
    billable_by_day: dict[str, int]
    counted_by_day: dict[str, int]
    given_back_by_day: dict[str, int]  # rows closed not billable: their units were given back
    outbox: int
    outbox_sent: int
    stripe_events: int  # kept by Stripe
    stripe_calls: int  # every meter-event call that reached Stripe, failed ones included
    stripe_replays: int
    billed_twice: list[str] = field(default_factory=list)  # (a)
    sent_twice: dict[str, int] = field(default_factory=dict)  # (b) identifier -> events sent again
    stripe_missing: list[str] = field(default_factory=list)  # (b)
    stripe_extra: list[str] = field(default_factory=list)  # (b)
    unaccounted: dict[str, int] = field(default_factory=dict)  # (c) "account:day" -> counter - billable rows

    @property
    def billable(self) -> int:
        return sum(self.billable_by_day.values())

    @property
    def counted(self) -> int:
        return sum(self.counted_by_day.values())

    @property
    def given_back(self) -> int:
        return sum(self.given_back_by_day.values())

    @property
    def charged_twice(self) -> int:
        """Requests billed twice in the ledger, plus meter events sent twice to Stripe."""
        return len(self.billed_twice) + sum(self.sent_twice.values())

    @property
    def settled(self) -> bool:
        """Nothing open, every unit accounted for, and Stripe has every billable event and no other."""
        return (self.open_rows == 0 and not self.unaccounted and not self.stripe_missing and not self.stripe_extra
                and self.billed == self.outbox == self.outbox_sent == self.stripe_events)

    @property
    def clean(self) -> bool:
        return self.settled and self.charged_twice == 0

    def faults(self) -> list[str]:
        """What is wrong, in words (empty when clean)."""
        found = []
        if self.billed_twice:
            found.append(f"{len(self.billed_twice)} request(s) with more than one billable row: {self.billed_twice[:5]}")
        if self.sent_twice:
            found.append(f"{sum(self.sent_twice.values())} meter event(s) sent twice: {sorted(self.sent_twice)[:5]}")
        if self.stripe_missing:
            found.append(f"{len(self.stripe_missing)} billable request(s) Stripe never kept: {self.stripe_missing[:5]}")
        if self.stripe_extra:
            found.append(f"{len(self.stripe_extra)} meter event(s) for requests not billable: {self.stripe_extra[:5]}")
        if self.unaccounted:
            found.append(f"quota units counted minus billable rows: {self.unaccounted}")
        if self.open_rows:
            found.append(f"{self.open_rows} ledger row(s) still open")
        if not self.billed == self.outbox == self.outbox_sent == self.stripe_events:
            found.append(f"billable at a price {self.billed}, outbox {self.outbox} ({self.outbox_sent} sent), "
                         f"Stripe kept {self.stripe_events}")
        return found


def audit(books: Books) -> Audit:
    billable_ids = Counter(row.request_id for row in books.ledger if row.billable)
    billable_by_day: Counter[str] = Counter()
    given_back_by_day: Counter[str] = Counter()
    billable_units: Counter[tuple[int, str]] = Counter()
    for row in books.ledger:
        if row.quota_day is None or row.batch:  # a batch line takes no unit of the daily quota
            continue
        if row.billable:
            billable_by_day[row.quota_day] += 1
            billable_units[(row.account_id, row.quota_day)] += 1
        elif not row.open:
            given_back_by_day[row.quota_day] += 1
    counted_by_day: Counter[str] = Counter()
    for (_account, day), units in books.counters.items():
        counted_by_day[day] += units
    unaccounted = {f"{account}:{day}": books.counters.get((account, day), 0) - billable_units[(account, day)]
                   for account, day in set(books.counters) | set(billable_units)}
    # Stripe must bill what the ledger closed billable, on a priced plan, for an account on Stripe.
    to_bill = {row.request_id for row in books.ledger
               if row.billable and not row.open and row.priced and row.on_stripe}
    kept = {call.identifier for call in books.received if call.answer is Answer.KEPT}
    sent = {call.identifier for call in books.received}
    return Audit(
        rows=len(books.ledger), open_rows=sum(1 for row in books.ledger if row.open),
        billed=sum(1 for row in books.ledger if row.billable and not row.open and row.priced),
        billable_by_day={day: n for day, n in billable_by_day.items() if n},
        counted_by_day={day: n for day, n in counted_by_day.items() if n},
        given_back_by_day=dict(given_back_by_day), outbox=len(books.outbox),
        outbox_sent=sum(1 for status in books.outbox.values() if status == "sent"),
        stripe_events=sum(1 for call in books.received if call.answer is Answer.KEPT),
        stripe_calls=len(books.received),
        stripe_replays=sum(1 for call in books.received if call.answer is Answer.REPLAYED),
        billed_twice=sorted(rid for rid, n in billable_ids.items() if n > 1),
        sent_twice=dict(Counter(call.identifier for call in books.received if call.answer is Answer.DUPLICATE)),
        stripe_missing=sorted(to_bill - kept), stripe_extra=sorted(sent - to_bill),
        unaccounted={where: n for where, n in sorted(unaccounted.items()) if n})
