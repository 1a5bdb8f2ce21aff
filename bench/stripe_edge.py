"""Stripe's network edge, for tests and the fault benchmark: forwards to localstripe, and answers what
localstripe lacks (Checkout, the portal, meter events) the way Stripe documents it.

Meter events: one kept per ``identifier`` (a second one is refused with Stripe's 400), and an
``Idempotency-Key`` replays the first answer. Every meter-event call is recorded in ``received``
with what it was answered, duplicates included, so an audit can count the events sent twice (which
Stripe refuses, and so would never show among those it kept). Faults on demand: the next
``fail_meter_events`` calls answer 500; a fraction ``failure_rate`` answer 500 or 503 at random; a
fraction ``lost_answer_rate`` record the event, then hold the answer past the client's timeout (the
worst case for a sender: Stripe has it, the sender does not know).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

import httpx
from aiohttp import web

from flatfare.redis_local import free_port


class Answer(StrEnum):
    """What the edge did with a meter-event call."""

    KEPT = "kept"  # a new identifier: Stripe bills it
    REPLAYED = "replayed"  # an Idempotency-Key seen before: the first answer again, nothing new billed
    DUPLICATE = "duplicate"  # an identifier kept before, under another key: refused with a 400
    FAILED = "failed"  # a fault on demand (500/503): nothing kept


@dataclass(frozen=True, slots=True)
class MeterCall:
    """One meter-event call that reached the edge."""

    identifier: str
    idempotency_key: str
    answer: Answer
    form: dict[str, str]


class StripeEdge:
    def __init__(self, upstream: str = "", *, seed: int = 0) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.checkouts: list[dict[str, str]] = []
        self.meter_events: list[dict[str, str]] = []  # kept, one per identifier
        self.received: list[MeterCall] = []  # every meter-event call, in order, whatever it was answered
        self.deliveries: Counter[str] = Counter()  # identifier -> calls that reached the edge
        self.fail_meter_events = 0
        self.failure_rate = 0.0
        self.lost_answer_rate = 0.0
        self.hold_s = 5.0
        self._answers: dict[str, web.Response] = {}  # Idempotency-Key -> the first answer's body
        self._identifiers: set[str] = set()
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def duplicates(self) -> int:
        """Meter events sent again for an identifier already kept, under another Idempotency-Key: each
        would be billed again by a Stripe that did not check identifiers."""
        return sum(1 for call in self.received if call.answer is Answer.DUPLICATE)

    async def _meter_event(self, request: web.Request, form: dict[str, str]) -> web.Response:
        identifier = form.get("identifier", "")
        key = request.headers.get("Idempotency-Key", "")
        self.deliveries[identifier] += 1

        def record(answer: Answer) -> None:
            self.received.append(MeterCall(identifier, key, answer, form))

        if self.fail_meter_events > 0:
            self.fail_meter_events -= 1
            record(Answer.FAILED)
            return _error(500, "api_error", "try later")
        if self._random.random() < self.failure_rate:
            record(Answer.FAILED)
            return _error(self._random.choice((500, 503)), "api_error", "try later")
        if key in self._answers:
            record(Answer.REPLAYED)
            return web.json_response(self._answers[key])
        if identifier in self._identifiers:
            record(Answer.DUPLICATE)
            return _error(400, "invalid_request_error", f"An event with identifier {identifier} already exists.")
        self._identifiers.add(identifier)
        record(Answer.KEPT)
        self.meter_events.append(form)
        answer = {"object": "billing.meter_event", "event_name": form["event_name"], "identifier": identifier,
                  "payload": {}, "timestamp": 0, "created": 0, "livemode": False}
        if key:
            self._answers[key] = answer
        if self._random.random() < self.lost_answer_rate:
            await asyncio.sleep(self.hold_s)  # recorded, but the caller gives up first
        return web.json_response(answer)

    async def _handle(self, request: web.Request) -> web.Response:
        form = dict(await request.post()) if request.method == "POST" else {}
        if request.path == "/v1/billing/meter_events":
            return await self._meter_event(request, form)
        if request.path == "/v1/checkout/sessions":
            self.checkouts.append(form)
            session_id = f"cs_test_{len(self.checkouts)}"
            return web.json_response({"id": session_id, "object": "checkout.session",
                                      "url": f"https://checkout.stripe.test/{session_id}"})
        if request.path == "/v1/billing_portal/sessions":
            return web.json_response({"id": "bps_1", "object": "billing_portal.session",
                                      "url": "https://billing.stripe.test/p/session_1"})
        if not self.upstream:
            return _error(404, "invalid_request_error", f"{request.path} is not served here")
        async with httpx.AsyncClient() as client:
            upstream = await client.request(request.method, f"{self.upstream}{request.path_qs}",
                                            content=await request.read(), headers=dict(request.headers))
        return web.Response(body=upstream.content, status=upstream.status_code, content_type="application/json")

    def start(self) -> StripeEdge:
        self._thread.start()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)

        async def serve() -> None:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(10)
        self._runner = runner
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)
