"""How a worker takes jobs: its own stream first, then the premium lane, then the standard lane,
with a guaranteed share for standard, and within a lane one job per account in turn, then the batch
lane with what capacity the live lanes leave idle; lease renewal; taking over the jobs of dead workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from flatfare import contract
from flatfare.contract import Lane

Entry = tuple[bytes, dict[bytes, bytes]]

# One claim pass, without blocking. KEYS: 1 the worker's own stream, 2 and 3 the premium and the
# standard lane's streams, 4 and 5 their rings of accounts, 6 and 7 their queued counters, 8 the pool's
# wake stream, 9 the batch lane's stream. ARGV: 1 consumer group, 2 consumer, 3 free slots, 4 of them the
# standard lane may take, 5 '1' when standard's earned slot comes first, 6 and 7 the premium and standard
# account queues' key prefix (the account id follows), 8 slots the batch lane may take (the free ones
# beyond the reserve kept for live traffic).
# A lane is served one job per account in turn: the next account of the ring (LMOVE rotates it to
# the back) gives its oldest job, which moves into the lane's stream; the lane's stream is then read
# through the consumer group, so a job taken is pending there, under this worker's lease, exactly as
# before. An account whose queue empties leaves the ring. Returns {taken, wake}: taken = {{i, entries},
# ...} (i: 1 own, 2 premium, 3 standard, 4 batch) and wake = the wake stream's last id, to block from.
_PASS = """
local group, consumer = ARGV[1], ARGV[2]
local free, standard_free = tonumber(ARGV[3]), tonumber(ARGV[4])
local taken = {}
local function read(i, stream, most)
  if most <= 0 then return 0 end
  local ok, reply = pcall(redis.call, 'XREADGROUP', 'GROUP', group, consumer, 'COUNT', most, 'STREAMS', stream, '>')
  if not ok then  -- no group: a Redis that lost its data (a job moved here just now made the stream)
    redis.pcall('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
    ok, reply = pcall(redis.call, 'XREADGROUP', 'GROUP', group, consumer, 'COUNT', most, 'STREAMS', stream, '>')
  end
  if ok and reply and reply[1] and #reply[1][2] > 0 then
    taken[#taken + 1] = {i, reply[1][2]}
    return #reply[1][2]
  end
  return 0
end
local function serve(i, most)
  if most <= 0 then return 0 end
  local stream, ring, queued, prefix = KEYS[i], KEYS[i + 2], KEYS[i + 4], ARGV[i + 4]
  local moved = 0
  while moved < most do
    local account = redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
    if not account then break end
    local queue = prefix .. account
    local first = redis.call('XRANGE', queue, '-', '+', 'COUNT', 1)
    if #first == 0 then
      redis.call('LREM', ring, -1, account)
    else
      redis.call('XDEL', queue, first[1][1])
      redis.call('XADD', stream, '*', unpack(first[1][2]))
      redis.call('DECR', queued)
      moved = moved + 1
      if redis.call('XLEN', queue) == 0 then
        redis.call('DEL', queue)
        redis.call('LREM', ring, -1, account)
      end
    end
  end
  return read(i, stream, most)
end
free = free - read(1, KEYS[1], free)
if ARGV[5] == '1' and standard_free > 0 then
  local got = serve(3, math.min(1, free))
  free, standard_free = free - got, standard_free - got
end
free = free - serve(2, free)
free = free - serve(3, math.min(free, standard_free))
-- Batch jobs only with slots to spare and nothing waiting on either live lane: a live request
-- admitted now still finds this worker's reserve, and one already waiting is taken first.
local batch_free = math.min(free, tonumber(ARGV[8]))
if batch_free > 0 and tonumber(redis.call('GET', KEYS[6]) or '0') <= 0
    and tonumber(redis.call('GET', KEYS[7]) or '0') <= 0 then
  read(4, KEYS[9], batch_free)
end
local last = redis.call('XREVRANGE', KEYS[8], '+', '-', 'COUNT', 1)
return {taken, last[1] and last[1][1] or '0-0'}
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
        lanes = (Lane.PREMIUM, Lane.STANDARD)
        self.lanes = {lane: contract.job_stream(model, lane) for lane in lanes}
        self.rings = {lane: contract.lane_ring(model, lane) for lane in lanes}
        self.queued = {lane: contract.queued_key(model, lane) for lane in lanes}
        # account_queue(model, lane, "") is the prefix every account id completes.
        self.queue_prefixes = {lane: contract.account_queue(model, lane, "") for lane in lanes}
        self.wake = contract.wake_stream(model)
        self.batch = contract.job_stream(model, Lane.BATCH)
        self._pass_script = redis.register_script(_PASS)

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
        premium, standard = self.lanes[Lane.PREMIUM], self.lanes[Lane.STANDARD]
        keys = [self.own, premium, standard, *self.rings.values(), *self.queued.values(), self.wake, self.batch]
        args = [contract.POOL_GROUP, self.worker_id, free, standard_free, int(self.share.standard_first()),
                *self.queue_prefixes.values(), batch_free]
        taken, wake = await self._pass_script(keys=keys, args=args)
        streams = {1: (self.own, None), 2: (premium, Lane.PREMIUM), 3: (standard, Lane.STANDARD),
                   4: (self.batch, Lane.BATCH)}
        claimed: list[Claimed] = []
        for index, entries in taken:
            stream, lane = streams[int(index)]
            parsed: list[Entry] = [(entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
                                   for entry_id, fields in entries]
            claimed.append(Claimed(stream, lane, parsed))
            self.share.took(lane, len(parsed))
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
