"""The dispatcher's bookkeeping against a real redis-server and each SQL database: a line's result is
recorded and billed once however often its reply is read, and recovery tells a line whose job still
runs from one whose job was lost (run again) or whose output had begun (failed, free)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from flatfare import contract
from flatfare.billing.ledger import Ledger
from flatfare.billing.plans import quota_window
from flatfare.contract import Endpoint, Job, Lane, Reply, ReplyKind, Usage
from flatfare.gateway.batches.dispatcher import BatchDispatcher
from flatfare.gateway.openai.admission import Admission
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.jobpath.pools import Pools
from flatfare.storage.accounts import issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.models import Batch, BatchLine, BatchLineStatus, BatchStatus, Plan, RequestRecord


async def _batch(sessions, lines: int) -> str:
    async with sessions() as session, session.begin():
        await session.execute(update(Plan).where(Plan.name == "pro").values(price_per_request_micros=2000,
                                                                            batch_discount_percent=50))
        account = await ensure_account(session, "acme", "pro")
        key = await issue_key(session, account)
        now = datetime.now(UTC)
        session.add(Batch(id="batch_t", account_id=account.id, api_key_id=key.key_id, endpoint="/v1/chat/completions",
                          input_file_id="file-x", completion_window="24h", status=BatchStatus.IN_PROGRESS.value,
                          total=lines, completed=0, failed=0, created_at=now, expires_at=now + timedelta(hours=24)))
        await session.flush()
        for line in range(lines):
            session.add(BatchLine(batch_id="batch_t", line=line, custom_id=f"c{line}", model="m", body="{}",
                                  status=BatchLineStatus.QUEUED.value))
    return "batch_t"


def _dispatcher(redis, sessions) -> BatchDispatcher:
    pools = Pools(redis, sessions, 0.5)
    return BatchDispatcher(redis, sessions, None, pools, Admission(pools), PlanBook(sessions, 0.5))  # type: ignore[arg-type]


async def _reply(redis, line: int, reply: Reply) -> None:
    await redis.xadd(contract.BATCH_REPLIES, reply.to_fields(contract.batch_request_id("batch_t", line)))


async def test_a_reply_read_twice_is_recorded_and_billed_once(redis, sessions) -> None:
    await _batch(sessions, 2)
    dispatcher = _dispatcher(redis, sessions)
    await dispatcher.collector.setup()
    answer = Reply(ReplyKind.RESPONSE, '{"object": "chat.completion"}', usage=Usage(5, 3))
    await _reply(redis, 0, answer)
    await dispatcher.collector.drain()
    await _reply(redis, 0, answer)  # a job run again after a takeover answers a second time
    await _reply(redis, 0, answer)
    await _reply(redis, 1, Reply(ReplyKind.ERROR, '{"error": {"message": "boom"}}', status=500))
    await dispatcher.collector.drain()
    async with sessions() as session:
        rows = (await session.execute(select(RequestRecord.id, RequestRecord.billable, RequestRecord.price_micros,
                                             RequestRecord.endpoint).order_by(RequestRecord.id))).all()
        batch = await session.get(Batch, "batch_t")
    assert [tuple(r) for r in rows] == [("batch_t-0", True, 1000, "batch:chat"), ("batch_t-1", False, 0, "batch:chat")]
    assert (batch.completed, batch.failed) == (1, 1)
    assert await redis.xlen(contract.BATCH_REPLIES) == 0
    # A rebuild of the live quota's counters from the ledger leaves batch lines out.
    ledger = Ledger(sessions)
    try:
        assert await ledger.billable_counts([quota_window("UTC", datetime.now(UTC)).day]) == {}
    finally:
        ledger.dispose()


async def test_a_dispatcher_that_died_before_acknowledging_leaves_its_replies_to_the_next(redis, sessions) -> None:
    await _batch(sessions, 1)
    first = _dispatcher(redis, sessions)
    await first.collector.setup()
    await _reply(redis, 0, Reply(ReplyKind.RESPONSE, "{}", usage=Usage(1, 1)))
    # Read but never recorded nor acknowledged: the process died right there.
    await redis.xreadgroup(contract.BATCH_GROUP, "leader", {contract.BATCH_REPLIES: ">"})
    await _dispatcher(redis, sessions).collector.drain()
    async with sessions() as session:
        line = await session.get(BatchLine, ("batch_t", 0))
    assert line.status == BatchLineStatus.DONE.value


async def test_recovery_reruns_lost_lines_only_and_fails_those_whose_output_began(redis, sessions) -> None:
    await _batch(sessions, 3)
    dispatcher = _dispatcher(redis, sessions)
    await dispatcher.collector.setup()
    # Line 0's job is still on the lane (waiting or running); 1 and 2 were lost, and 2 had begun.
    job = Job(contract.batch_request_id("batch_t", 0), Endpoint.CHAT, "{}", 0, lane=Lane.BATCH,
              reply_to=contract.BATCH_REPLIES)
    await redis.xadd(contract.job_stream("m", Lane.BATCH), job.to_fields())
    await redis.set(contract.begun_key(contract.batch_request_id("batch_t", 2)), 1)
    await dispatcher.recover()
    async with sessions() as session:
        states = dict((await session.execute(select(BatchLine.line, BatchLine.status)
                                             .where(BatchLine.batch_id == "batch_t"))).all())
        failed = await session.get(BatchLine, ("batch_t", 2))
        batch = await session.get(Batch, "batch_t")
    assert states == {0: "queued", 1: "pending", 2: "failed"}
    assert failed.status_code == 502 and "worker_lost" in failed.result and batch.failed == 1
