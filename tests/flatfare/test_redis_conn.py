"""REDIS_DOWN catches what an absent or stalled Redis raises, through Flatfare's own client."""

from __future__ import annotations

import asyncio

import pytest

from flatfare.redis_conn import REDIS_DOWN, connect
from flatfare.redis_local import free_port


async def test_a_refused_connection_is_redis_down() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        with pytest.raises(REDIS_DOWN):
            await client.ping()
    finally:
        await client.aclose()


async def test_a_bounded_command_that_runs_out_of_time_is_redis_down(redis_url: str) -> None:
    # The workers and the reply router bound a command with asyncio.timeout (flatfare.redis_conn.
    # without_read_timeouts): its TimeoutError is an OSError, so REDIS_DOWN needs no third member.
    client = connect(redis_url)
    try:
        with pytest.raises(REDIS_DOWN):
            async with asyncio.timeout(0.2):
                await client.blpop(["nothing-comes"], timeout=30)
    finally:
        await client.aclose()
