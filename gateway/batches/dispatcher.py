"""The batch dispatcher: in one gateway process at a time (a lease in Redis, ``BATCH_LEADER_KEY``), it
validates new batches, feeds their lines as jobs onto the batch lane of each line's pool a few at a
time while the pool's live lanes have nothing queued, records the results (:mod:`.collector`), stops
cancelled and expired batches, and writes each finished batch's output and error files.

Everything a batch has done is in SQL (its lines' states), so a dispatcher that starts (a gateway
restarted, another process took the lease) resumes from there. A line that is queued in SQL but
whose job and reply are both gone (Redis lost them, or a job was skipped as cancelled) is run again
only if no output of it went out (``contract.begun_key``); otherwise it fails, free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy import Update, exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract, tracecontext
from flatfare.billing.ledger import BATCH_ENDPOINT_PREFIX
from flatfare.billing.plans import AccountTerms, quota_window
from flatfare.contract import Endpoint, Job, Lane
from flatfare.contract.jobs import text_of
from flatfare.lanes import feed as lanes
from flatfare.leases import Lease
from flatfare.tracing import Tracer
from flatfare.gateway.auth import Caller, caller_of
from flatfare.gateway.batches.collector import ResultCollector
from flatfare.gateway.batches.files import BatchFiles
from flatfare.gateway.batches.lines import InputError, InputLine, not_run_line, output_line, parse_input
from flatfare.gateway.batches.protocol import ENDPOINTS
from flatfare.gateway.errors import APIError, error_body
from flatfare.gateway.openai.admission import Admission
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.jobpath.pools import Pools
from flatfare.storage.models import Account, ApiKey, Batch, BatchLine, BatchLineStatus, BatchStatus, RequestRecord

log = logging.getLogger("flatfare.batches")

# Batch jobs waiting or running per pool at once: enough to keep idle slots busy, few enough that a
# live burst finds the batch lane short (each claim pass reads it only after both live lanes).
FEED_WINDOW = 8
PASS_MS = 200
# How often the leader looks for queued lines whose job and reply are both gone.
RECOVER_EVERY_S = 5.0
LEASE_S = 10
PENDING_SCAN = 500
_ACTIVE = (BatchStatus.IN_PROGRESS.value, BatchStatus.CANCELLING.value, BatchStatus.FINALIZING.value)
_UNFINISHED = (BatchLineStatus.PENDING.value, BatchLineStatus.QUEUED.value)


def _error_list(errors: list[InputError]) -> dict[str, Any]:
    return {"object": "list", "data": [error.to_dict() for error in errors[:100]]}


def _failing(batch_id: str, errors: list[InputError]) -> Update:
    """A validating batch failed with ``errors`` (a cancel that came first wins)."""
    return update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING.value).values(
        status=BatchStatus.FAILED.value, failed_at=datetime.now(UTC), errors=_error_list(errors))


def _now_ms() -> int:
    return int(time.time() * 1000)


class BatchDispatcher:
    def __init__(self, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession], files: BatchFiles,
                 pools: Pools, admission: Admission, plans: PlanBook, feed_window: int = FEED_WINDOW,
                 on_line: Callable[[str, bool], None] | None = None, tracer: Tracer | None = None) -> None:
        self.redis = redis
        self._tracer = tracer
        self._sessions = sessions
        self._files = files
        self._pools = pools
        self._admission = admission
        self._plans = plans
        self.feed_window = feed_window
        self.collector = ResultCollector(redis, sessions, on_line)
        self._cancels_sent: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch while this process holds the lease; otherwise wait to take it over."""
        lease = Lease(self.redis, contract.BATCH_LEADER_KEY, LEASE_S)
        leading = False
        next_recovery = 0.0
        while not stop.is_set():
            try:
                if await lease.hold():
                    if not leading:  # a new leader trusts nothing in flight: it resumes from SQL
                        await self.collector.setup()
                        leading, next_recovery = True, 0.0
                        self._cancels_sent.clear()
                    started = time.monotonic()
                    recover = started >= next_recovery
                    await self.step(recover=recover)
                    if recover:
                        next_recovery = time.monotonic() + RECOVER_EVERY_S
                    # At most one pass per PASS_MS however fast replies come: the gateway's CPU is
                    # live traffic's first, and a pass records every reply waiting at once.
                    await asyncio.sleep(max(started + PASS_MS / 1000 - time.monotonic(), 0))
                    continue
                leading = False
            except Exception:  # noqa: BLE001 - the loop must outlive a database or Redis hiccup
                log.exception("batch dispatch pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PASS_MS * 5 / 1000)

    async def step(self, *, recover: bool = False) -> None:
        """One pass: results in, lost lines found (``recover``), batches validated, stopped, fed, finished."""
        await self.collector.drain()
        if recover:
            await self.recover()
        await self._validate()
        await self._stop_lines()
        await self._feed()
        await self._finish()

    # -- validating --------------------------------------------------------------------------

    async def _validate(self) -> None:
        async with self._sessions() as session:
            waiting = (await session.scalars(select(Batch).where(Batch.status == BatchStatus.VALIDATING.value)
                                             .order_by(Batch.created_at).limit(10))).all()
        for batch in waiting:
            raw = await self._files.input_lines(batch.account_id, batch.input_file_id)
            if raw is None:
                await self._fail(batch.id, [InputError("invalid_input_file", f"The input file {batch.input_file_id} "
                                                       "is gone (deleted or expired).")])
                continue
            lines, errors = parse_input(raw, batch.endpoint)
            if errors:
                await self._fail(batch.id, errors)
                continue
            await self._start(batch, lines)

    async def _fail(self, batch_id: str, errors: list[InputError]) -> None:
        async with self._sessions() as session, session.begin():
            await session.execute(_failing(batch_id, errors))

    async def _start(self, batch: Batch, lines: list[InputLine]) -> None:
        """Check every line as the same request sent live would be (nothing is written meanwhile), then
        start the batch: its lines queued, those refused failed, free, with the live path's error."""
        now = datetime.now(UTC)
        async with self._sessions() as session:
            account = await session.get(Account, batch.account_id)
            key = await session.get(ApiKey, batch.api_key_id)
            assert account is not None and key is not None
            session.expunge(account)
        terms = await self._plans.terms(account, now)
        caller = caller_of(account, key)
        checked = [await self._checked(ENDPOINTS[batch.endpoint], line, caller, terms) for line in lines]
        async with self._sessions() as session, session.begin():
            limit = terms.plan.batch_daily_limit
            if limit is not None:
                used = await _allowance_used(session, account.id, quota_window(terms.plan.timezone, now).day)
                if used + len(lines) > limit:
                    message = (f"This batch's {len(lines)} requests exceed the plan's batch allowance: "
                               f"{max(limit - used, 0)} of {limit} left today. Send a smaller batch or wait "
                               "for the allowance to reset.")
                    await session.execute(_failing(batch.id, [InputError("batch_allowance_exceeded", message)]))
                    return
            started = await session.execute(update(Batch).where(
                Batch.id == batch.id, Batch.status == BatchStatus.VALIDATING.value).values(
                status=BatchStatus.IN_PROGRESS.value, in_progress_at=now, total=len(lines)))
            if not started.rowcount:  # cancelled meanwhile: it never runs
                return
            refused = 0
            for index, (line, (body, refusal)) in enumerate(zip(lines, checked, strict=True)):
                refused += refusal is not None
                session.add(BatchLine(batch_id=batch.id, line=index, custom_id=line.custom_id, model=line.model,
                                      body=body, status=(BatchLineStatus.FAILED if refusal
                                                         else BatchLineStatus.PENDING).value,
                                      status_code=refusal.status if refusal else None,
                                      result=json.dumps(error_body(refusal.status, refusal.message, param=refusal.param,
                                                                   code=refusal.code)) if refusal else None))
            if refused:
                await session.execute(update(Batch).where(Batch.id == batch.id).values(failed=refused))

    async def _checked(self, endpoint: Endpoint, line: InputLine, caller: Caller,
                       terms: AccountTerms) -> tuple[str, APIError | None]:
        """A line through the admission every live request takes (flatfare.gateway.openai.admission): the
        body its job carries, or the error refusing it. A refused line is free and never runs."""
        try:
            request = await self._admission.check(endpoint, line.body.encode(), caller, terms, batch_line=True)
        except APIError as exc:
            return line.body, exc
        return request.job_body(), None

    async def _pool(self, model: str, dedicated: str | None) -> str:
        """The pool a line of ``model`` runs in, as a live request would be routed (a LoRA variant's is
        its base model's; the account's dedicated one while it has warm workers); the model's own name
        while no pool can serve it, where its lines wait."""
        try:
            return (await self._pools.route(model, dedicated)).name or model
        except APIError:
            return model

    # -- stopping, feeding, finishing --------------------------------------------------------

    async def _stop_lines(self) -> None:
        """Cancelled and expired batches: pending lines will not run; running ones are cancelled."""
        now = datetime.now(UTC)
        async with self._sessions() as session, session.begin():
            stopping = (await session.scalars(select(Batch.id).where(
                (Batch.status == BatchStatus.CANCELLING.value)
                | ((Batch.status == BatchStatus.IN_PROGRESS.value) & (Batch.expires_at <= now))))).all()
            if not stopping:
                return
            await session.execute(update(BatchLine).where(BatchLine.batch_id.in_(stopping),
                                                          BatchLine.status == BatchLineStatus.PENDING.value)
                                  .values(status=BatchLineStatus.NOT_RUN.value))
            running = (await session.execute(select(BatchLine.batch_id, BatchLine.line).where(
                BatchLine.batch_id.in_(stopping), BatchLine.status == BatchLineStatus.QUEUED.value))).all()
        fresh = [contract.batch_request_id(b, n) for b, n in running]
        fresh = [rid for rid in fresh if rid not in self._cancels_sent]
        if fresh:
            async with self.redis.pipeline(transaction=False) as pipe:
                for request_id in fresh:
                    pipe.set(contract.cancel_key(request_id), 1, ex=contract.CANCEL_TTL_S)
                    pipe.publish(contract.CANCEL_CHANNEL, request_id)
                await pipe.execute()
            self._cancels_sent.update(fresh)

    async def _feed(self) -> None:
        now = datetime.now(UTC)
        async with self._sessions() as session:
            rows = (await session.execute(
                select(BatchLine.batch_id, BatchLine.line, BatchLine.model, BatchLine.body, Batch.endpoint,
                       Account.dedicated_pool)
                .join(Batch, Batch.id == BatchLine.batch_id).join(Account, Account.id == Batch.account_id)
                .where(BatchLine.status == BatchLineStatus.PENDING.value,
                       Batch.status == BatchStatus.IN_PROGRESS.value, Batch.expires_at > now)
                .order_by(Batch.created_at, Batch.id, BatchLine.line).limit(PENDING_SCAN))).all()
        if not rows:
            return
        by_pool: dict[str, list[Any]] = defaultdict(list)
        routed: dict[tuple[str, str | None], str] = {}
        for row in rows:
            where = (row.model, row.dedicated_pool)
            if where not in routed:
                routed[where] = await self._pool(*where)
            by_pool[routed[where]].append(row)
        room = await lanes.batch_room(self.redis, list(by_pool), self.feed_window)
        chosen = {pool: by_pool[pool][:room[pool]] for pool in by_pool if room[pool] > 0}
        if not chosen:
            return
        # Queued in SQL before the jobs exist: a dispatcher that dies in between leaves queued lines
        # without a job, which recovery finds and runs (nothing of theirs went out).
        async with self._sessions() as session, session.begin():
            for lines in chosen.values():
                for row in lines:
                    await session.execute(update(BatchLine).where(
                        BatchLine.batch_id == row.batch_id, BatchLine.line == row.line).values(
                        status=BatchLineStatus.QUEUED.value))
        enqueued = _now_ms()
        traces = await self._traces({row.batch_id for lines in chosen.values() for row in lines})
        await lanes.feed(self.redis, {pool: [
            Job(request_id=contract.batch_request_id(row.batch_id, row.line), endpoint=ENDPOINTS[row.endpoint],
                body=row.body, enqueued_ms=enqueued, lane=Lane.BATCH, reply_to=contract.BATCH_REPLIES,
                traceparent=self._line_traceparent(traces.get(row.batch_id), row.batch_id, row.line))
            for row in lines] for pool, lines in chosen.items()})

    def _line_traceparent(self, parent: str | None, batch_id: str, line: int) -> str:
        """A line's span, under the span of the request that created its batch: the job carries it, the
        worker's spans for the line are its children."""
        if self._tracer is None:
            return tracecontext.continue_or_start(parent).header()
        trace, spans = self._tracer.start("batch line", parent, kind="producer",
                                          **{"flatfare.request_id": contract.batch_request_id(batch_id, line),
                                             "flatfare.batch_id": batch_id})
        if spans is not None:
            spans.finish()
        return trace.header()

    async def _traces(self, batch_ids: set[str]) -> dict[str, str]:
        """The traceparent of the request that created each batch, where Redis still has it: each line is
        a span of its own in that trace (in a new trace of its own otherwise)."""
        ids = sorted(batch_ids)
        values = await self.redis.mget([contract.batch_trace_key(batch_id) for batch_id in ids])
        return {batch_id: text_of(value) for batch_id, value in zip(ids, values, strict=True) if value}

    async def _finish(self) -> None:
        """Batches with no line left to run: their files written, their final status set."""
        now = datetime.now(UTC)
        unfinished = exists().where(BatchLine.batch_id == Batch.id, BatchLine.status.in_(_UNFINISHED))
        async with self._sessions() as session:
            done = (await session.scalars(select(Batch).where(Batch.status.in_(_ACTIVE), ~unfinished))).all()
        for batch in done:
            if batch.status == BatchStatus.CANCELLING.value:
                final, moment, code = BatchStatus.CANCELLED, "cancelled_at", "batch_cancelled"
            elif batch.expires_at <= now:
                final, moment, code = BatchStatus.EXPIRED, "expired_at", "batch_expired"
            else:
                final, moment, code = BatchStatus.COMPLETED, "completed_at", ""
            if batch.status == BatchStatus.IN_PROGRESS.value and final is BatchStatus.COMPLETED:
                async with self._sessions() as session, session.begin():
                    await session.execute(update(Batch).where(Batch.id == batch.id).values(
                        status=BatchStatus.FINALIZING.value, finalizing_at=now))
            output, errors = await self._write_files(batch, code)
            async with self._sessions() as session, session.begin():
                await session.execute(update(Batch).where(Batch.id == batch.id, Batch.status.in_(_ACTIVE)).values(
                    status=final.value, output_file_id=output, error_file_id=errors, **{moment: datetime.now(UTC)}))

    async def _write_files(self, batch: Batch, not_run_code: str) -> tuple[str | None, str | None]:
        async with self._sessions() as session:
            lines = (await session.scalars(select(BatchLine).where(BatchLine.batch_id == batch.id)
                                           .order_by(BatchLine.line))).all()
        answers: list[str] = []
        errors: list[str] = []
        for line in lines:
            request_id = contract.batch_request_id(batch.id, line.line)
            if line.status == BatchLineStatus.DONE.value:
                answers.append(output_line(request_id, line.custom_id, line.status_code or 200, line.result or "{}"))
            elif line.status == BatchLineStatus.FAILED.value:
                errors.append(output_line(request_id, line.custom_id, line.status_code or 500, line.result or "{}"))
            else:
                reason = "cancelled" if not_run_code == "batch_cancelled" else "expired"
                errors.append(not_run_line(request_id, line.custom_id, not_run_code,
                                           f"This request was not run: its batch {reason} first."))
        output = await self._files.write_output(batch.account_id, f"{batch.id}_output.jsonl", answers) \
            if answers else None
        error = await self._files.write_output(batch.account_id, f"{batch.id}_error.jsonl", errors) if errors else None
        return output, error

    # -- recovery ----------------------------------------------------------------------------

    async def recover(self) -> None:
        """Queued lines whose job is gone from the batch lane and whose reply never came: run again,
        unless output of theirs went out (then failed, free) or their batch is stopping (not run)."""
        queued = await self._queued_lines()
        if not queued:
            return
        present: set[str] = set()
        for pool in {pool for _, _, pool, _ in queued}:
            for _entry_id, fields in await self.redis.xrange(contract.job_stream(pool, Lane.BATCH)):
                present.add(fields.get(b"id", b"").decode())
        # A worker writes a job's reply before it deletes the job: replies of jobs gone from the
        # lane are all in the reply stream by now.
        await self.collector.drain()
        still = {(b, n) for b, n, _, _ in await self._queued_lines()}
        lost = [(b, n, status) for b, n, _, status in queued
                if (b, n) in still and contract.batch_request_id(b, n) not in present]
        if not lost:
            return
        begun = await self.redis.mget([contract.begun_key(contract.batch_request_id(b, n)) for b, n, _ in lost])
        worker_lost = json.dumps(contract.error_body("The worker running this request was lost in the middle of its "
                                                     "answer.", "server_error", code="worker_lost"))
        async with self._sessions() as session, session.begin():
            for (batch_id, line, status), went_out in zip(lost, begun, strict=True):
                values: dict[str, Any]
                if went_out is not None:
                    values = {"status": BatchLineStatus.FAILED.value, "status_code": 502, "result": worker_lost}
                    await session.execute(update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + 1))
                elif status != BatchStatus.IN_PROGRESS.value:
                    values = {"status": BatchLineStatus.NOT_RUN.value}
                else:
                    values = {"status": BatchLineStatus.PENDING.value}
                await session.execute(update(BatchLine).where(
                    BatchLine.batch_id == batch_id, BatchLine.line == line,
                    BatchLine.status == BatchLineStatus.QUEUED.value).values(**values))
        log.info("recovered %d batch lines whose jobs were lost", len(lost))

    async def _queued_lines(self) -> list[tuple[str, int, str, str]]:
        """(batch id, line, pool, batch status) of every queued line."""
        async with self._sessions() as session:
            rows = (await session.execute(
                select(BatchLine.batch_id, BatchLine.line, BatchLine.model, Account.dedicated_pool, Batch.status)
                .join(Batch, Batch.id == BatchLine.batch_id).join(Account, Account.id == Batch.account_id)
                .where(BatchLine.status == BatchLineStatus.QUEUED.value))).all()
        routed = {where: await self._pool(*where) for where in {(r.model, r.dedicated_pool) for r in rows}}
        return [(r.batch_id, r.line, routed[(r.model, r.dedicated_pool)], r.status) for r in rows]


async def _allowance_used(session: AsyncSession, account_id: int, day: str) -> int:
    """The account's batch lines billed on ``day`` plus those waiting to run in its batches."""
    billed = await session.scalar(select(func.count()).select_from(RequestRecord).where(
        RequestRecord.account_id == account_id, RequestRecord.quota_day == day, RequestRecord.billable.is_(True),
        RequestRecord.endpoint.startswith(BATCH_ENDPOINT_PREFIX)))
    waiting = await session.scalar(
        select(func.count()).select_from(BatchLine).join(Batch, Batch.id == BatchLine.batch_id)
        .where(Batch.account_id == account_id, BatchLine.status.in_(_UNFINISHED)))
    return int(billed or 0) + int(waiting or 0)
