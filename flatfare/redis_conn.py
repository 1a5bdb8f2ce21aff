"""One way to open the asyncio Redis client every Flatfare process uses."""

from __future__ import annotations

import redis.asyncio as aioredis

# Blocking reads (XREAD/XREADGROUP BLOCK) wait at most 5 s, well inside this socket timeout;
# redis-py's own default (5 s) would cut a loaded server's blocking reply short.
SOCKET_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5
# Each request waiting on its reply stream holds one connection in a blocking read, so the pool
# must be as large as the number of requests a process may hold (redis-py 8 defaults to 100).
MAX_CONNECTIONS = 20_000


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                             max_connections=MAX_CONNECTIONS)
