"""How a worker takes jobs: its own stream first, then the premium lane, then the standard lane,
with a guaranteed share for standard; lease renewal; taking over the jobs of dead workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from flatfare import contract
from flatfare.contract import Lane

Entry = tuple[bytes, dict[bytes, bytes]]

# One claim pass: XREADGROUP each stream in order (KEYS), at most ARGV[3+i] from the i-th and no
# more than ARGV[3] in all, without blocking. Returns {{i, entries}, ...} for the streams that had any.
_PASS = """
local free = tonumber(ARGV[3])
local taken = {}
for i, key in ipairs(KEYS) do
  if free <= 0 then break end
  local most = math.min(tonumber(ARGV[3 + i]), free)
  local ok, reply = pcall(redis.call, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', most, 'STREAMS', key, '>')
  if ok and reply and reply[1] and #reply[1][2] > 0 then
    taken[#taken + 1] = {i, reply[1][2]}
    free = free - #reply[1][2]
  end
end
return taken
"""


@dataclass(frozen=True, slots=True)
class Claimed:
    stream: str
    lane: Lane | None  # None: the worker's own stream (prefix-routed jobs)
    entries: list[Entry]
    reclaimed: bool = False


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
        self.own = contract.worker_stream(model, worker_id)
        self.lanes = {lane: contract.job_stream(model, lane) for lane in (Lane.PREMIUM, Lane.STANDARD)}
        self._pass = redis.register_script(_PASS)

    async def setup(self) -> None:
        for stream in (self.own, *self.lanes.values()):
            await ensure_group(self.redis, stream)

    async def _read(self, stream: str, count: int, block: int | None = None) -> list[Entry]:
        result = await self.redis.xreadgroup(contract.POOL_GROUP, self.worker_id, {stream: ">"}, count=count,
                                             block=block)
        return [entry for _stream, entries in result or [] for entry in entries]

    async def claim(self, free: int, block_ms: int = 1000) -> list[Claimed]:
        """Up to ``free`` new jobs, in lane order; blocks up to ``block_ms`` when there are none."""
        premium, standard = self.lanes[Lane.PREMIUM], self.lanes[Lane.STANDARD]
        # (stream, lane, most to take): standard's earned slot comes before premium.
        order: list[tuple[str, Lane | None, int]] = [(self.own, None, free)]
        if self.share.standard_first():
            order.append((standard, Lane.STANDARD, 1))
        order += [(premium, Lane.PREMIUM, free), (standard, Lane.STANDARD, free)]
        claimed: list[Claimed] = []
        # The whole pass is one script (it was a round trip per stream, three a claim when idle).
        taken = await self._pass(keys=[stream for stream, _, _ in order],
                                 args=[contract.POOL_GROUP, self.worker_id, free, *(most for _, _, most in order)])
        for index, entries in taken:
            stream, lane, _ = order[int(index) - 1]
            parsed: list[Entry] = [(entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
                                   for entry_id, fields in entries]
            claimed.append(Claimed(stream, lane, parsed))
            self.share.took(lane, len(parsed))
            free -= len(parsed)
        if claimed or free <= 0:
            return claimed
        # Nothing anywhere: wait on all three at once, one job each at most.
        streams = {self.own: ">", self.lanes[Lane.PREMIUM]: ">", self.lanes[Lane.STANDARD]: ">"}
        result = await self.redis.xreadgroup(contract.POOL_GROUP, self.worker_id, streams, count=1, block=block_ms)
        lanes_by_stream = {self.own: None, **{s: lane for lane, s in self.lanes.items()}}
        for raw_stream, entries in result or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            if entries:
                claimed.append(Claimed(stream, lanes_by_stream[stream], list(entries)))
                self.share.took(lanes_by_stream[stream], len(entries))
        return claimed

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
        for lane, stream in self.lanes.items():
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
