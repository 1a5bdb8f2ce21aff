"""A worker's claim pass: its own stream first, then the premium lane, then the standard lane (with a
guaranteed share), within a lane one job per account in turn, then the batch lane with what capacity
the live lanes leave idle; one script, without blocking. The worker keeps its side (the standard
lane's earned share, lease renewal, takeovers) in :mod:`flatfare.workers.claims`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatfare import contract
from flatfare.contract import Lane
from flatfare.lanes.scripts import Lua

Entry = tuple[bytes, dict[bytes, bytes]]

# KEYS: 1 the worker's own stream, 2 and 3 the premium and the standard lane's streams, 4 and 5 their
# rings of accounts, 6 and 7 their queued counters, 8 the pool's wake stream, 9 the batch lane's stream.
# ARGV: 1 consumer group, 2 consumer, 3 free slots, 4 of them the standard lane may take, 5 '1' when
# standard's earned slot comes first, 6 and 7 the premium and standard account queues' key prefix (the
# account id follows), 8 slots the batch lane may take (the free ones beyond the reserve kept for live
# traffic).
# A lane is served one job per account in turn: the next account of the ring (LMOVE rotates it to
# the back) gives its oldest job, which moves into the lane's stream; the lane's stream is then read
# through the consumer group, so a job taken is pending there, under this worker's lease. An account
# whose queue empties leaves the ring. Batch jobs only with slots to spare and nothing waiting on
# either live lane: a live request admitted now still finds this worker's reserve, and one already
# waiting is taken first. Returns {taken, wake}: taken = {{i, entries}, ...} (i: 1 own, 2 premium,
# 3 standard, 4 batch) and wake = the wake stream's last id, to block from.
PASS = Lua("""
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
local batch_free = math.min(free, tonumber(ARGV[8]))
if batch_free > 0 and tonumber(redis.call('GET', KEYS[6]) or '0') <= 0
    and tonumber(redis.call('GET', KEYS[7]) or '0') <= 0 then
  read(4, KEYS[9], batch_free)
end
local last = redis.call('XREVRANGE', KEYS[8], '+', '-', 'COUNT', 1)
return {taken, last[1] and last[1][1] or '0-0'}
""")

_LIVE = (Lane.PREMIUM, Lane.STANDARD)


@dataclass(frozen=True, slots=True)
class Claimed:
    stream: str
    lane: Lane | None  # None: the worker's own stream (prefix-routed jobs)
    entries: list[Entry]
    reclaimed: bool = False


class ClaimKeys:
    """The keys one worker of a pool claims from, named once (the claim runs every time a slot frees)."""

    def __init__(self, pool: str, worker_id: str) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.own = contract.worker_stream(pool, worker_id)
        self.lanes = {lane: contract.job_stream(pool, lane) for lane in _LIVE}
        self.batch = contract.job_stream(pool, Lane.BATCH)
        self.wake = contract.wake_stream(pool)
        self.script = [self.own, *self.lanes.values(), *(contract.lane_ring(pool, lane) for lane in _LIVE),
                       *(contract.queued_key(pool, lane) for lane in _LIVE), self.wake, self.batch]
        # account_queue(pool, lane, "") is the prefix every account id completes.
        self.queue_prefixes = [contract.account_queue(pool, lane, "") for lane in _LIVE]
        # The pass's stream numbers: what it took from, and on which lane.
        self.streams: dict[int, tuple[str, Lane | None]] = {
            1: (self.own, None), 2: (self.lanes[Lane.PREMIUM], Lane.PREMIUM),
            3: (self.lanes[Lane.STANDARD], Lane.STANDARD), 4: (self.batch, Lane.BATCH)}


async def claim_pass(redis: object, keys: ClaimKeys, *, free: int, standard_free: int, standard_first: bool,
                     batch_free: int = 0) -> tuple[list[Claimed], bytes | str]:
    """One pass: up to ``free`` new jobs in lane order, at most ``standard_free`` of them from the standard
    lane and ``batch_free`` from the batch lane; and the wake stream's last id, to block from."""
    args = [contract.POOL_GROUP, keys.worker_id, free, standard_free, int(standard_first), *keys.queue_prefixes,
            batch_free]
    taken, wake = await PASS.run(redis, keys.script, args)
    claimed: list[Claimed] = []
    for index, entries in taken:
        stream, lane = keys.streams[int(index)]
        parsed: list[Entry] = [(entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
                               for entry_id, fields in entries]
        claimed.append(Claimed(stream, lane, parsed))
    return claimed, wake
