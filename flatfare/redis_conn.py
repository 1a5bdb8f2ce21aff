"""One way to open the asyncio Redis client every Flatfare process uses."""

from __future__ import annotations

import asyncio

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import RedisError

# What Redis being away (down, restarting, unreachable, or too slow) raises: redis-py's own errors
# and the OSErrors its sockets let through bare. OSError takes in ConnectionError and TimeoutError,
# which ``asyncio.timeout`` raises (since Python 3.11 asyncio.TimeoutError is that same class).
REDIS_DOWN: tuple[type[Exception], ...] = (RedisError, OSError)


def stop_if_cancelled() -> None:
    """Re-raise a cancellation that came out as a Redis error: a loop that retries on REDIS_DOWN calls
    this first, so that cancelling its task still stops it (a cancellation in the middle of a redis-py
    command can surface as a connection error, and the retry would then swallow it)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError

# Blocking reads (XREAD/XREADGROUP BLOCK) wait at most 5 s, well inside this socket timeout;
# redis-py's own default (5 s) would cut a loaded server's blocking reply short.
SOCKET_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5
# Each request waiting on its reply stream holds one connection in a blocking read, so the pool
# must be as large as the number of requests a process may hold (redis-py 8 defaults to 100).
MAX_CONNECTIONS = 20_000


class _HiredisPacking:
    """Packs commands with hiredis's C packer: redis-py's asyncio connections pack in Python, which cost
    ~27 µs for a job's admission script against ~3 µs here (the gateway's biggest Redis cost)."""

    def pack_command(self, *args: object) -> list[bytes]:
        first = args[0]
        if isinstance(first, str) and " " in first:  # "CONFIG GET": the server wants separate words
            args = (*first.split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        return [hiredis.pack_command(args)]


class _TCP(_HiredisPacking, Connection):
    pass


class _TLS(_HiredisPacking, SSLConnection):
    pass


class _Unix(_HiredisPacking, UnixDomainSocketConnection):
    pass


_PACKING = {Connection: _TCP, SSLConnection: _TLS, UnixDomainSocketConnection: _Unix}


def connect(url: str) -> aioredis.Redis:
    client = aioredis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                               max_connections=MAX_CONNECTIONS)
    pool = client.connection_pool
    pool.connection_class = _PACKING.get(pool.connection_class, pool.connection_class)
    return client


def without_read_timeouts(client: aioredis.Redis) -> aioredis.Redis:
    """A client to the same server whose sends and reads carry no timeout each: redis-py wraps every
    send in ``asyncio.wait_for`` and every reply it reads in an ``asyncio.timeout`` (a pipeline of 200
    replies: 200 timers), which was an eighth of the worker's CPU. Callers bound a whole pipeline or
    command with one ``asyncio.timeout(SOCKET_TIMEOUT_S)``."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": None}
    return aioredis.Redis(connection_pool=aioredis.ConnectionPool(connection_class=pool.connection_class,
                                                                  max_connections=pool.max_connections, **kwargs))
