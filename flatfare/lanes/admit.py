"""Admission to a lane, and withdrawal from it: the one script that counts a request and queues its job.

:func:`admit` is one round trip: it checks and counts the account's daily quota and the API key's,
checks the account's and the key's requests in flight against their caps, checks the lane's depth
and adds the job to its account's queue on the lane (the claim script serves a lane's accounts in
turn), or to a worker's own stream (prefix-aware routing), holds the unit in the gateway process's
held-units hash and rings the pool's wake stream, atomically; it also records the key's client for
shared-key detection (:class:`KeySighting`) and refuses a key used from more addresses at once than
its plan allows. A refusal of any kind leaves nothing behind: no unit counted, nothing in flight, no
job, no sighting. The counters are trusted only while the quota
epoch marker exists: without it the script counts nothing and says so (:attr:`Verdict.REBUILDING`),
and the caller rebuilds them from the ledger (flatfare.billing.quota) before it tries again.
:func:`withdraw` takes back a job no worker has been given yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum

from flatfare import contract
from flatfare.contract import Job, Lane
from flatfare.lanes.scripts import Lua

# KEYS: 1 the account's counter of the day, 2 the quota epoch marker, 3 where the job goes (the
# account's queue on its lane, or a worker's own stream), 4 the gateway process's held units, 5 the
# key's counter of the day, 6 the account's in-flight set, 7 the key's in-flight set, 8 the lane's
# queued counter, 9 the lane's ring of accounts, 10 the pool's wake stream.
# ARGV: 1 the account's daily limit (-1: none), 2 the counters' expiry (unix s), 3 the lane's bound,
# 4 the consumer group, 5 the request id, 6 the held value ("account:day:key"), 7 the key's daily cap
# (-1: none; '': no key counted), 8 the account's in-flight cap (-1: none), 9 the key's in-flight cap
# (-1: none; '': no key), 10 now (ms), 11 when the in-flight entry stops counting (ms), 12 the account
# id, 13 'fair' (the account's queue) or 'direct' (a worker's stream), 14... the sighting (below),
# 21... the job's fields.
# The key's sighting (shared-key detection, :class:`KeySighting`): KEYS 11 the key's addresses of the
# day (a HyperLogLog), 12 its user agents of the day, 13 its recent addresses (a sorted set by last use,
# ms), 14 the day's set of keys past their plan's alert threshold; ARGV 14 the address's keyed hash
# ('': nothing recorded), 15 the user agent's, 16 the alert threshold (-1: none), 17 the addresses the
# key may be used from at once (-1: no cap), 18 that window (ms), 19 how long the day's records are
# kept (s), 20 the key id.
# Returns {-1, 0}: counters being rebuilt; {0, used}: the account's quota spent; {3, used, key used}:
# the key's cap reached; {4, used, in flight}: the account's in-flight cap; {5, used, in flight}: the
# key's; {6, used, addresses}: the key was used from as many other addresses in the window as it may;
# {2, used, queued}: lane full; {1, used, queued, entry id, generation, key used}: counted, held,
# queued. Nothing is counted, and no sighting recorded, before every check passed.
# In-flight entries of requests that ended are removed by the worker with the terminal reply (and by
# the gateway when it settles); a dead process's expire at ARGV[11]. Every request is in its account's
# set, capped or not: the set is also how a gateway tells, after Redis lost its data, a lost job from
# a live one.
ADMIT = Lua("""
local generation = redis.call('GET', KEYS[2])
if not generation then return {-1, 0} end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[1] ~= '-1' and used >= tonumber(ARGV[1]) then return {0, used} end
local key_used = 0
if ARGV[7] ~= '' then
    key_used = tonumber(redis.call('GET', KEYS[5]) or '0')
    if ARGV[7] ~= '-1' and key_used >= tonumber(ARGV[7]) then return {3, used, key_used} end
end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', ARGV[10])
local inflight = redis.call('ZCARD', KEYS[6])
if ARGV[8] ~= '-1' and inflight >= tonumber(ARGV[8]) then return {4, used, inflight} end
if ARGV[9] ~= '' then
    redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', ARGV[10])
    local key_inflight = redis.call('ZCARD', KEYS[7])
    if ARGV[9] ~= '-1' and key_inflight >= tonumber(ARGV[9]) then return {5, used, key_inflight} end
end
local seen = ARGV[14] ~= ''
if seen and ARGV[17] ~= '-1' then
    redis.call('ZREMRANGEBYSCORE', KEYS[13], '-inf', tonumber(ARGV[10]) - tonumber(ARGV[18]))
    if not redis.call('ZSCORE', KEYS[13], ARGV[14]) then
        local addresses = redis.call('ZCARD', KEYS[13])
        if addresses >= tonumber(ARGV[17]) then return {6, used, addresses} end
    end
end
local fair = ARGV[13] == 'fair'
local queued
if fair then
    queued = tonumber(redis.call('GET', KEYS[8]) or '0')
else
    local ok, pending = pcall(redis.call, 'XPENDING', KEYS[3], ARGV[4])
    queued = redis.call('XLEN', KEYS[3]) - (ok and pending[1] or 0)
end
if queued >= tonumber(ARGV[3]) then return {2, used, queued} end
used = redis.call('INCR', KEYS[1])
redis.call('EXPIREAT', KEYS[1], ARGV[2])
if ARGV[7] ~= '' then
    key_used = redis.call('INCR', KEYS[5])
    redis.call('EXPIREAT', KEYS[5], ARGV[2])
end
redis.call('HSET', KEYS[4], ARGV[5], ARGV[6])
redis.call('ZADD', KEYS[6], ARGV[11], ARGV[5])
if ARGV[9] ~= '' then redis.call('ZADD', KEYS[7], ARGV[11], ARGV[5]) end
if seen then
    -- A new address makes PFADD answer 1: only then can the count have passed the threshold.
    if redis.call('PFADD', KEYS[11], ARGV[14]) == 1 then
        redis.call('EXPIRE', KEYS[11], ARGV[19])
        if ARGV[16] ~= '-1' and redis.call('PFCOUNT', KEYS[11]) > tonumber(ARGV[16]) then
            redis.call('SADD', KEYS[14], ARGV[20])
            redis.call('EXPIRE', KEYS[14], ARGV[19])
        end
    end
    if redis.call('PFADD', KEYS[12], ARGV[15]) == 1 then redis.call('EXPIRE', KEYS[12], ARGV[19]) end
    if ARGV[17] ~= '-1' then
        redis.call('ZADD', KEYS[13], ARGV[10], ARGV[14])
        redis.call('PEXPIRE', KEYS[13], ARGV[18])
    end
end
local fields = {}
for i = 21, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
if fair then
    redis.call('INCR', KEYS[8])
    if redis.call('XLEN', KEYS[3]) == 1 then redis.call('RPUSH', KEYS[9], ARGV[12]) end
end
redis.call('XADD', KEYS[10], 'MAXLEN', '~', 64, '*', 'j', 1)
return {1, used, queued + 1, id, generation, key_used}
""")

# A job in its account's queue is still waiting while its entry is there (atomic against the claim
# script, which moves it out). KEYS: 1 the account's queue, 2 the lane's queued counter, 3 the lane's
# ring. ARGV: 1 the entry id, 2 the account id. Returns 1 if it was taken back, else 0.
WITHDRAW_FAIR = Lua("""
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DECR', KEYS[2])
if redis.call('XLEN', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[1])
    redis.call('LREM', KEYS[3], 0, ARGV[2])
end
return 1
""")
# A job routed to a worker's own stream is still waiting while no worker has read it. KEYS: 1 the
# stream. ARGV: 1 the entry id, 2 the consumer group. Returns 1 if it was taken back, else 0.
WITHDRAW_DIRECT = Lua("""
local ok, held = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2], ARGV[1], ARGV[1], 1)
if ok and #held > 0 then return 0 end
return redis.call('XDEL', KEYS[1], ARGV[1])
""")


class Verdict(IntEnum):
    REBUILDING = -1
    QUOTA_SPENT = 0
    ADMITTED = 1
    LANE_FULL = 2
    KEY_QUOTA_SPENT = 3
    ACCOUNT_BUSY = 4
    KEY_BUSY = 5
    KEY_SHARED = 6


@dataclass(frozen=True, slots=True)
class QuotaClaim:
    """The unit a request asks to count: the account's counter for the day and its limit, and the
    API key's counter with the key's own cap (``key_id`` None: no key counted)."""

    account_id: int
    day: str
    limit: int | None
    expire_at: int
    key_id: int | None = None
    key_limit: int | None = None
    # Requests in flight (queued or running) the account, and the key, may have at once (None: no cap).
    max_inflight: int | None = None
    key_max_inflight: int | None = None
    # When an in-flight entry left by a process that died stops counting (unix ms; 0: an hour on).
    inflight_expires_ms: int = 0
    # The key's client, recorded when admitted (None: nothing recorded, e.g. no key or no address).
    sighting: KeySighting | None = None


@dataclass(frozen=True, slots=True)
class KeySighting:
    """What the script records of the client using an API key (shared-key detection): its address and
    user agent as keyed hashes (never the values), into the key's counts of the UTC ``day``, and the
    plan's rules: the distinct addresses a day past which the key is listed as shared (``alert_at``,
    None: not listed), and the addresses it may be used from within ``window_ms`` (``max_addresses``,
    None: no cap; past it a request from another address is refused and nothing counted)."""

    address: str
    agent: str
    day: str
    keep_s: int
    alert_at: int | None = None
    max_addresses: int | None = None
    window_ms: int = 600_000


@dataclass(frozen=True, slots=True)
class Queued:
    """Where an admitted job waits: its account's queue on the lane (``lane`` set), or a worker's own
    stream (``lane`` None); ``depth``: the jobs waiting there, it included."""

    stream: str
    entry_id: str
    depth: int
    account_id: int = 0
    lane: Lane | None = None
    pool: str = ""


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """What the admission script said. ``used``: the account's count (after counting, if admitted);
    ``key_used``: the key's; ``inflight``: what a busy verdict found in flight (a shared key's: its other
    addresses in the window); ``depth``: what waits
    where the job would go (it included, if admitted); ``queued`` and ``generation`` (the counters'
    generation it was counted in): set when admitted."""

    verdict: Verdict
    used: int = 0
    key_used: int = 0
    inflight: int = 0
    depth: int = 0
    queued: Queued | None = None
    generation: str = ""


def _cap(value: int | None) -> int:
    return -1 if value is None else value


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def admit(redis: object, job: Job, pool: str, claim: QuotaClaim, *, holder: str, held: str, max_depth: int,
                stream: str | None = None) -> AdmitResult:
    """Run the admission script for ``job`` on ``pool``: to its account's queue on its lane, or to the
    worker stream ``stream``. ``holder``: the gateway process's held-units hash; ``held``: what it
    records of the unit (``flatfare.billing.quota.held_value``)."""
    fair = stream is None
    target = contract.account_queue(pool, job.lane, claim.account_id) if fair else stream
    no_key = claim.key_id is None
    key_id = 0 if no_key else claim.key_id
    keys = [contract.quota_counter_key(claim.account_id, claim.day), contract.QUOTA_EPOCH_KEY, target, holder,
            contract.key_quota_counter_key(key_id, claim.day), contract.inflight_key(claim.account_id),
            contract.key_inflight_key(key_id), contract.queued_key(pool, job.lane),
            contract.lane_ring(pool, job.lane), contract.wake_stream(pool)]
    seen = claim.sighting if not no_key else None
    day = seen.day if seen is not None else claim.day
    keys += [contract.key_addresses_key(key_id, day), contract.key_agents_key(key_id, day),
             contract.key_recent_addresses_key(key_id), contract.shared_keys_key(day)]
    now_ms = int(time.time() * 1000)
    fields = [item for pair in job.to_fields().items() for item in pair]
    args = [_cap(claim.limit), claim.expire_at, max_depth, contract.POOL_GROUP, job.request_id, held,
            "" if no_key else _cap(claim.key_limit), _cap(claim.max_inflight),
            "" if no_key else _cap(claim.key_max_inflight), now_ms, claim.inflight_expires_ms or now_ms + 3_600_000,
            claim.account_id, "fair" if fair else "direct",
            *(("", "", -1, -1, 0, 0, 0) if seen is None else
              (seen.address, seen.agent, _cap(seen.alert_at), _cap(seen.max_addresses), seen.window_ms, seen.keep_s,
               key_id)),
            *fields]
    verdict, used, *rest = await ADMIT.run(redis, keys, args)
    verdict = Verdict(verdict)
    if verdict is Verdict.ADMITTED:
        depth, entry_id, generation, key_used = int(rest[0]), _text(rest[1]), _text(rest[2]), int(rest[3])
        queued = Queued(target, entry_id, depth, claim.account_id, job.lane if fair else None, pool)
        return AdmitResult(verdict, int(used), key_used, depth=depth, queued=queued, generation=generation)
    if verdict is Verdict.KEY_QUOTA_SPENT:
        return AdmitResult(verdict, int(used), key_used=int(rest[0]))
    if verdict in (Verdict.ACCOUNT_BUSY, Verdict.KEY_BUSY, Verdict.KEY_SHARED):
        return AdmitResult(verdict, int(used), inflight=int(rest[0]))
    if verdict is Verdict.LANE_FULL:
        return AdmitResult(verdict, int(used), depth=int(rest[0]))
    return AdmitResult(verdict, int(used))


async def withdraw(redis: object, queued: Queued) -> bool:
    """True if the job was still waiting and is now gone; False if a worker has it."""
    if queued.lane is None:
        return bool(await WITHDRAW_DIRECT.run(redis, [queued.stream], [queued.entry_id, contract.POOL_GROUP]))
    keys = [queued.stream, contract.queued_key(queued.pool, queued.lane), contract.lane_ring(queued.pool, queued.lane)]
    return bool(await WITHDRAW_FAIR.run(redis, keys, [queued.entry_id, queued.account_id]))
