"""What waits for a pool's workers, read from Redis in one step per pool: each live lane's queue (its
accounts' queues and its stream's entries no worker was given yet), the jobs taken and not finished,
and the jobs routed to its workers' own streams (prefix-aware routing), dead workers' included.

One definition for everyone who asks "does this model need an engine?": the gateway's /metrics (the
``flatfare_model_demand`` gauge a KEDA trigger reads), the admin console, and the fleet supervisor,
which starts or wakes a model's engine while its demand is above zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flatfare import contract


@dataclass(frozen=True, slots=True)
class QueueDepth:
    model: str
    lane: str
    waiting: int
    claimed: int
    oldest_wait_s: float



# Accounts whose oldest waiting job is looked at for a lane's oldest wait (the ring's first ones: a
# lane served in turn has its oldest jobs near the front).
_OLDEST_OF = 64

# One pool's queues, read in one step so the numbers agree with each other. KEYS: 1 and 2 the premium
# and the standard lane's streams, 3 and 4 their rings of accounts, 5 and 6 their queued counters, 7
# the pool's workers by heartbeat (every one still listed, live or not: a dead worker's own stream
# may hold jobs). ARGV: 1 the consumer group, 2 and 3 the premium and standard account queues' key
# prefix (the account id follows), 4 the workers' own streams' prefix (the worker id follows), 5 how
# many accounts of a ring to look at for the oldest wait. Every key it touches carries the pool's
# hash tag, as the claim script's do (flatfare/lanes/claim.py).
# Returns, per lane: jobs waiting (its accounts' queues, and entries of its stream no worker was
# given yet), jobs taken and not finished (pending in its stream), the ms of the oldest waiting one
# (-1: none); then the same waiting and taken counts over the workers' own streams (prefix-routed
# jobs, which no lane counts).
_POOL_QUEUES = """
local group = ARGV[1]
local function ms(id) return tonumber(string.match(id, '^(%d+)')) end
local function backlog(stream)
  local length = redis.call('XLEN', stream)
  if length == 0 then return 0, 0, false end
  local taken, last = 0, nil
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if ok then
    for _, g in ipairs(groups) do
      local f = {}
      for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
      if f['name'] == group then taken, last = f['pending'], f['last-delivered-id'] end
    end
  end
  local waiting = math.max(length - taken, 0)
  local first = false
  if waiting > 0 then
    local entries = redis.call('XRANGE', stream, last and ('(' .. last) or '-', '+', 'COUNT', 1)
    if entries[1] then first = ms(entries[1][1]) end
  end
  return waiting, taken, first
end
local out = {}
for i = 1, 2 do
  local waiting, taken, oldest = backlog(KEYS[i])
  waiting = waiting + math.max(tonumber(redis.call('GET', KEYS[i + 4]) or '0'), 0)
  for _, account in ipairs(redis.call('LRANGE', KEYS[i + 2], 0, tonumber(ARGV[5]) - 1)) do
    local first = redis.call('XRANGE', ARGV[i + 1] .. account, '-', '+', 'COUNT', 1)
    if first[1] then
      local t = ms(first[1][1])
      if not oldest or t < oldest then oldest = t end
    end
  end
  for _, v in ipairs({waiting, taken, oldest or -1}) do table.insert(out, v) end
end
local waiting, taken = 0, 0
for _, worker in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  local w, t = backlog(ARGV[4] .. worker)
  waiting, taken = waiting + w, taken + t
end
table.insert(out, waiting)
table.insert(out, taken)
return out
"""

_LANES = contract.LIVE_LANES


@dataclass(frozen=True, slots=True)
class PoolQueues:
    """One pool's queues: each lane's, and the jobs routed to its workers' own streams."""

    lanes: tuple[QueueDepth, ...]
    routed_waiting: int = 0
    routed_taken: int = 0

    @property
    def demand(self) -> int:
        """Jobs that need a worker of the pool: waiting anywhere, or taken and not finished (a dead
        worker's are taken over by a live one). 0 means the pool may scale to zero."""
        return sum(q.waiting + q.claimed for q in self.lanes) + self.routed_waiting + self.routed_taken


async def pool_queues(redis: Any, pools: Iterable[str], now_ms: int) -> dict[str, PoolQueues]:
    """The queues of ``pools``: one script per pool, all of them in one round trip."""
    pools = list(pools)
    script = redis.register_script(_POOL_QUEUES)
    async with redis.pipeline(transaction=False) as pipe:
        for pool in pools:
            keys = [*(contract.job_stream(pool, lane) for lane in _LANES),
                    *(contract.lane_ring(pool, lane) for lane in _LANES),
                    *(contract.queued_key(pool, lane) for lane in _LANES), contract.pool_key(pool)]
            args = [contract.POOL_GROUP, *(contract.account_queue(pool, lane, "") for lane in _LANES),
                    contract.worker_stream(pool, ""), _OLDEST_OF]
            await script(keys=keys, args=args, client=pipe)
        results = await pipe.execute()
    found: dict[str, PoolQueues] = {}
    for pool, counts in zip(pools, results, strict=True):
        counts = [int(c) for c in counts]
        lanes = []
        for i, lane in enumerate(_LANES):
            waiting, taken, oldest_ms = counts[3 * i:3 * i + 3]
            oldest_wait_s = max(now_ms - oldest_ms, 0) / 1000 if oldest_ms >= 0 else 0.0
            lanes.append(QueueDepth(pool, lane.value, waiting, taken, oldest_wait_s))
        found[pool] = PoolQueues(tuple(lanes), counts[6], counts[7])
    return found
