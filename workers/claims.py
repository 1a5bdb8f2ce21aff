"""How a worker takes jobs: the lane queue's claim pass (:mod:`flatfare.lanes.claim`: its own stream first,
then the premium lane, then the standard lane, within a lane one job per account in turn, then the batch
lane with what capacity the live lanes leave idle), with the standard lane's guaranteed share earned
here; lease renewal; taking over the jobs of dead workers.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from flatfare import contract
from flatfare.contract import Lane
from flatfare.lanes.claim import ClaimKeys, Claimed, Entry, claim_pass

__all__ = ["Claimed", "Claimer", "LaneShare", "ensure_group"]

class LaneShare:
    """Anti-starvation: every premium claim earns standard ``share / (1 - share)`` of a slot; once
    standard holds a whole slot, the next claim round serves standard first. With the default share
    (0.2) standard gets at least one claim in five while it has work, however busy premium is."""

    def __init__(self, share: float = contract.STANDARD_SHARE) -> None:
        self._per_premium = share / (1.0 - share)
        self.credit = 0.0

    def standard_first(self) -> bool:
        return self.credit >= 1.0

    def took(self, lane: Lane | None, count: int) -> None:
        if lane is Lane.PREMIUM:
            self.credit = min(self.credit + count * self._per_premium, 8.0)
        elif lane is Lane.STANDARD:
            self.credit = max(self.credit - count, 0.0)


async def ensure_group(redis: aioredis.Redis, stream: str) -> None:
    try:
        await redis.xgroup_create(stream, contract.POOL_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class Claimer:
    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, share: LaneShare | None = None) -> None:
        self.redis = redis
        self.model = model
        self.worker_id = worker_id
        self.share = share or LaneShare()
        self.keys = ClaimKeys(model, worker_id)
        self.own = self.keys.own
        self.lanes = self.keys.lanes
        self.wake = self.keys.wake
        self.batch = self.keys.batch

    async def setup(self) -> None:
        for stream in (self.own, *self.lanes.values(), self.batch):
            await ensure_group(self.redis, stream)

    async def _read(self, stream: str, count: int, block: int | None = None) -> list[Entry]:
        result = await self.redis.xreadgroup(contract.POOL_GROUP, self.worker_id, {stream: ">"}, count=count,
                                             block=block)
        return [entry for _stream, entries in result or [] for entry in entries]

    async def claim(self, free: int, block_ms: int = 1000, standard_free: int | None = None,
                    batch_free: int = 0) -> list[Claimed]:
        """Up to ``free`` new jobs, in lane order, at most ``standard_free`` of them (default: all)
        from the standard lane and ``batch_free`` from the batch lane; blocks up to ``block_ms`` when
        there are none."""
        claimed, wake = await self._pass(free, free if standard_free is None else standard_free, batch_free)
        if claimed or free <= 0:
            return claimed
        # Nothing anywhere: wait for the next admission to this pool (from the id the pass saw, so
        # one that came in since is not missed), then look once more.
        await self.redis.xread({self.wake: wake}, count=1, block=block_ms)
        claimed, _ = await self._pass(free, free if standard_free is None else standard_free, batch_free)
        return claimed

    async def _pass(self, free: int, standard_free: int, batch_free: int = 0) -> tuple[list[Claimed], bytes | str]:
        claimed, wake = await claim_pass(self.redis, self.keys, free=free, standard_free=standard_free,
                                         standard_first=self.share.standard_first(), batch_free=batch_free)
        for batch in claimed:
            self.share.took(batch.lane, len(batch.entries))
        return claimed, wake

    async def renew(self, held: dict[str, list[bytes]]) -> set[tuple[str, bytes]]:
        """Reset the idle time of the jobs this worker holds, so nobody takes them over. Returns the
        (stream, entry id) of those no longer pending anywhere: Redis lost them with its data."""
        renewing = [(stream, ids) for stream, ids in held.items() if ids]
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, ids in renewing:
                pipe.xclaim(stream, contract.POOL_GROUP, self.worker_id, 0, ids, justid=True)
            results = await pipe.execute(raise_on_error=False)
        lost: set[tuple[str, bytes]] = set()
        for (stream, ids), result in zip(renewing, results, strict=True):
            if isinstance(result, ResponseError) and "NOGROUP" in str(result):  # the stream went
                lost.update((stream, entry_id) for entry_id in ids)
            elif isinstance(result, Exception):
                raise result
            else:
                claimed = set(result)
                lost.update((stream, entry_id) for entry_id in ids if entry_id not in claimed)
        return lost

    async def hand_back(self, held: dict[str, list[bytes]], lease_ms: int) -> None:
        """Make held jobs look abandoned at once, so another worker takes them over now."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, ids in held.items():
                if ids:
                    pipe.xclaim(stream, contract.POOL_GROUP, self.worker_id, 0, ids, idle=lease_ms * 10,
                                justid=True)
            await pipe.execute()

    async def take_over(self, free: int, lease_ms: int, live_workers: set[str]) -> list[Claimed]:
        """Jobs whose worker stopped renewing them (it died), and jobs routed to dead workers."""
        claimed: list[Claimed] = []
        for lane, stream in (*self.lanes.items(), (Lane.BATCH, self.batch)):
            if free <= 0:
                break
            _next, entries, *_ = await self.redis.xautoclaim(stream, contract.POOL_GROUP, self.worker_id,
                                                             lease_ms, start_id="0-0", count=free)
            entries = [e for e in entries if e[1]]  # deleted entries come back empty
            if entries:
                claimed.append(Claimed(stream, lane, entries, reclaimed=True))
                free -= len(entries)
        pattern = contract.worker_stream(self.model, "*")
        async for raw in self.redis.scan_iter(match=pattern, count=100):
            stream = raw.decode()
            owner = stream.rsplit(":w:", 1)[-1]
            if owner in live_workers or free <= 0:
                continue
            await ensure_group(self.redis, stream)
            _next, stale, *_ = await self.redis.xautoclaim(stream, contract.POOL_GROUP, self.worker_id, lease_ms,
                                                           start_id="0-0", count=free)
            fresh = await self._read(stream, max(free - len(stale), 0)) if free - len(stale) > 0 else []
            entries = [e for e in [*stale, *fresh] if e[1]]
            if entries:
                claimed.append(Claimed(stream, None, entries, reclaimed=True))
                free -= len(entries)
            elif not await self.redis.xlen(stream):
                await self.redis.delete(stream)
        return claimed
