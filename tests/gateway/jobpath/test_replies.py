"""The reply router (flatfare.gateway.jobpath.replies) against a real redis-server: one reader per process hands
every entry to its own request's inbox, a wait ends at its timeout or when the client leaves, and after
Redis lost its data only the jobs gone with it and silent are answered lost."""

from __future__ import annotations

import asyncio
import time

from flatfare.billing.quota import EPOCH_KEY
from flatfare import contract
from flatfare.contract import Reply, ReplyKind, Usage
from flatfare.gateway.jobpath.replies import ReplyRouter
# The fixture: conftest's client with the quota counters trusted (the epoch marker set).
from tests.gateway.jobpath.test_queueing_quota import redis  # noqa: F401


async def test_the_reply_router_hands_each_entry_to_its_own_request(redis) -> None:
    clock = [1000.0]
    router = ReplyRouter(redis, timeout_s=5.0, gateway_id="g1", clock=lambda: clock[0])
    router.start()
    try:
        first, second = router.open("a"), router.open("b")
        stream = contract.gateway_replies("g1")
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, '{"n":1}', started_ms=5).to_fields("a"))
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, "stale").to_fields("gone"))  # nobody waits for it
        await redis.xadd(stream, Reply(ReplyKind.RESPONSE, "{}", usage=Usage(3, 4)).to_fields("b"))
        await redis.xadd(stream, Reply(ReplyKind.END, usage=Usage(1, 2)).to_fields("a"))
        replies_a: list[Reply] = []
        deadline = time.monotonic() + 10
        while not replies_a or not replies_a[-1].kind.terminal:
            assert time.monotonic() < deadline, f"no terminal reply for 'a' within 10 s: {replies_a}"
            replies_a += await first.next(2.0)
        assert [r.kind for r in replies_a] == [ReplyKind.CHUNK, ReplyKind.END]
        assert replies_a[0].data == '{"n":1}' and replies_a[0].started_ms == 5 and replies_a[1].usage == Usage(1, 2)
        replies_b = await second.next(2.0)
        assert [r.kind for r in replies_b] == [ReplyKind.RESPONSE] and replies_b[0].usage == Usage(3, 4)
        router.close(first)
        router.close(second)
        assert router.holding == 0
        # What was read is trimmed (every 512 entries, or when the TTL is renewed, every 5 s), and the
        # stream expires if this process dies.
        clock[0] += 10
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, "x").to_fields("nobody"))
        for _ in range(50):
            if await redis.xlen(stream) <= 1:
                break
            await asyncio.sleep(0.05)
        assert await redis.xlen(stream) <= 1
        assert 0 < await redis.ttl(stream) <= contract.REPLY_TTL_S
    finally:
        await router.stop()


async def test_an_inbox_wait_ends_at_its_timeout_or_when_the_client_leaves(redis) -> None:
    router = ReplyRouter(redis, timeout_s=5.0, gateway_id="g2")
    inbox = router.open("c")
    assert await inbox.next(0.05) == []
    asyncio.get_running_loop().call_later(0.05, inbox.leave)
    assert await inbox.next(5.0) == [] and inbox.gone


async def _no_counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
    return {}


async def test_after_a_loss_only_jobs_gone_from_redis_and_silent_are_answered_lost(redis) -> None:
    """Once the counters' generation changes, the router watches what it holds: a request still in
    its account's in-flight set is left alone (a false alarm), one whose worker says HELD lives on,
    and one gone from Redis and silent for ``lost_after_s`` (at two looks) gets 503 job_lost."""
    router = ReplyRouter(redis, timeout_s=60.0, gateway_id="g3", lost_after_s=1.0)
    await redis.set(EPOCH_KEY, "gen-1")
    router.start()
    try:
        inflight = contract.inflight_key(1)
        queued, held, lost = router.open("q"), router.open("h"), router.open("l")
        for inbox in (queued, held, lost):
            await redis.zadd(inflight, {inbox.request_id: time.time() * 1000 + 60_000})
            router.admitted(inbox, inflight, inbox.request_id, "gen-1")
        await redis.zrem(inflight, "h", "l")  # their entries went with the data
        await redis.set(EPOCH_KEY, "gen-2")
        replies = contract.gateway_replies("g3")
        answer: list[Reply] = []
        deadline = time.monotonic() + 20
        while not answer:  # the worker running "h" says so, every half second
            assert time.monotonic() < deadline, "the lost job was never answered"
            await redis.xadd(replies, Reply(ReplyKind.HELD).to_fields("h"))
            answer = await lost.next(0.5)
        assert [(r.kind, r.status) for r in answer] == [(ReplyKind.ERROR, 503)]
        assert '"job_lost"' in answer[0].data
        assert await queued.next(0.01) == [] and await held.next(0.01) == []  # HELD is not an answer
    finally:
        await router.stop()
