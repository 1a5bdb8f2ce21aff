"""The checks of a request that need the network or Redis, run after validation and before the
request is counted: media hosts must resolve to public addresses, and an account may make the
engine compile only so many new output grammars a minute.

:mod:`flatfare.gateway.openai.media` refuses every URL it can judge from its text alone; a host *name* still has to
be resolved, with the running loop's resolver and a short timeout. A name that does not resolve
(or not in time) is refused too: the worker could not fetch it either, and an answer within the
timeout beats an engine-side failure after the fetch's own (VLLM_IMAGE_FETCH_TIMEOUT, retried).
The worker resolves the name again when it fetches, so a name whose answer changes between the
two (DNS rebinding) is only stopped by the worker's egress policy: docs/SECURITY.md.

Grammars: each distinct JSON schema, pattern or grammar costs the engine a compilation (up to about a
second for what :mod:`flatfare.gateway.openai.grammar_caps` lets through) before the request's first token, and the
engine's compiled-grammar cache is shared by everyone. Repeating a schema is free; a client sending a
new one with every request gets 429 past :attr:`RequestScreen.new_grammars_per_minute`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from flatfare.contract import grammars_key
from flatfare.gateway.openai import grammar_caps, media
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest

# host -> the addresses it resolves to, as text ("93.184.216.34", "2606:4700::1111").
Resolver = Callable[[str], Awaitable[list[str]]]
_WINDOW_S = 60
# A sliding window (a sorted set of digests by first use, in ms): one seen within the last window is
# free; a new one past the limit is refused ({0, ms until the oldest leaves}); else remembered.
# A fixed per-minute window let twice the limit through across a minute's boundary.
# ARGV: digest, limit, now (ms), window (ms).
_NEW_GRAMMAR = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[3]) - tonumber(ARGV[4]))
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {1, 0} end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(oldest[2]) + tonumber(ARGV[4]) - tonumber(ARGV[3])}
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, 0}
"""


async def system_resolver(host: str) -> list[str]:
    """The addresses ``host`` resolves to, through the running loop (uvloop's or asyncio's)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class RequestScreen:
    def __init__(self, redis: aioredis.Redis, *, resolve_timeout_s: float = 1.0, new_grammars_per_minute: int = 30,
                 resolver: Resolver = system_resolver) -> None:
        self._redis = redis
        self.resolve_timeout_s = resolve_timeout_s
        self.new_grammars_per_minute = new_grammars_per_minute
        self._resolver = resolver
        self._new_grammar = redis.register_script(_NEW_GRAMMAR)

    async def check(self, account_id: int, parsed: ChatCompletionRequest | CompletionRequest) -> None:
        """Raise the client's APIError for a request the engine must not get; nothing is counted."""
        if isinstance(parsed, ChatCompletionRequest):
            await self.check_hosts(media.media_refs(parsed.messages))
        digest = grammar_caps.constraint_digest(dict(parsed))
        if digest is not None:
            await self.check_grammar(account_id, digest)

    async def check_hosts(self, refs: list[media.MediaRef]) -> None:
        by_host: dict[str, media.MediaRef] = {}
        for ref in refs:
            host = media.host_of(ref)
            if host is not None:
                by_host.setdefault(host, ref)
        if by_host:
            await asyncio.gather(*(self._check_host(host, ref) for host, ref in by_host.items()))

    async def _check_host(self, host: str, ref: media.MediaRef) -> None:
        try:
            addresses = await asyncio.wait_for(self._resolver(host), self.resolve_timeout_s)
        except TimeoutError:
            raise ref.refuse(f"the host '{host}' did not resolve within {self.resolve_timeout_s:g} s.") from None
        except OSError:  # socket.gaierror and its kin
            raise ref.refuse(f"the host '{host}' does not resolve.") from None
        if not addresses:
            raise ref.refuse(f"the host '{host}' does not resolve.")
        for address in addresses:
            # getaddrinfo may add an IPv6 zone ("fe80::1%eth0"): ipaddress reads it.
            media.check_address(ref, ipaddress.ip_address(address))

    async def check_grammar(self, account_id: int, digest: str) -> None:
        allowed, wait_ms = await self._new_grammar(
            keys=[grammars_key(account_id)],
            args=[digest, self.new_grammars_per_minute, int(time.time() * 1000), _WINDOW_S * 1000])
        if not allowed:
            retry = max(int(wait_ms) // 1000 + 1, 1)
            raise APIError(429, f"This account sent {self.new_grammars_per_minute} different output schemas, "
                           "patterns or grammars in the last minute, each compiled by the engine; reuse one, or retry "
                           f"in {retry} s.", code="too_many_new_schemas", headers={"Retry-After": str(retry)})

