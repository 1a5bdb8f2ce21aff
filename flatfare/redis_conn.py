"""One way to open the asyncio Redis client every Flatfare process uses."""

from __future__ import annotations

import redis.asyncio as aioredis

# Blocking reads (XREAD/XREADGROUP BLOCK) wait at most 5 s, well inside this socket timeout;
# redis-py's own default (5 s) would cut a loaded server's blocking reply short.
SOCKET_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S)
