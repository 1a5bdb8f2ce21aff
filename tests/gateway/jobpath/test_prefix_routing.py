"""Prefix hashing and the routing decision, without HTTP (Redis is real)."""

from __future__ import annotations

import pytest

from flatfare import contract
from flatfare.contract import Endpoint, WorkerInfo
from flatfare.redis_conn import connect
from flatfare.gateway.jobpath.prefix_routing import PrefixRouter, prefix_hash

DOC = {"role": "system", "content": "contract clause " * 100}


def test_chat_prefix_is_everything_but_the_last_message() -> None:
    a = prefix_hash(Endpoint.CHAT, {"messages": [DOC, {"role": "user", "content": "one"}]})
    b = prefix_hash(Endpoint.CHAT, {"messages": [DOC, {"role": "user", "content": "two"}]})
    assert a and a == b
    assert prefix_hash(Endpoint.CHAT, {"messages": [{"role": "user", "content": "short"}]}) == ""
    assert prefix_hash(Endpoint.COMPLETION, {"prompt": "x" * 3000}) == prefix_hash(
        Endpoint.COMPLETION, {"prompt": "x" * 2048 + "different tail"})


def _worker(worker_id: str, inflight: int, capacity: int = 8) -> WorkerInfo:
    return WorkerInfo(worker_id, "m", 2048, capacity, inflight=inflight)


@pytest.fixture
async def router(redis_url: str):
    client = connect(redis_url)
    await client.set(contract.prefix_key("m", "h"), "w1")
    yield PrefixRouter(client, enabled=True)
    await client.aclose()


async def test_routes_to_the_owner_while_it_is_not_busy(router) -> None:
    assert await router.target("m", "h", (_worker("w1", 1), _worker("w2", 0))) == contract.worker_stream("m", "w1")
    # Busy: far more loaded than the least-loaded worker, or full.
    assert await router.target("m", "h", (_worker("w1", 5), _worker("w2", 0))) is None
    assert await router.target("m", "h", (_worker("w1", 8), _worker("w2", 8))) is None
    # Unknown prefix, dead owner, switched off.
    assert await router.target("m", "other", (_worker("w1", 0),)) is None
    assert await router.target("m", "h", (_worker("w2", 0),)) is None
    router.enabled = False
    assert await router.target("m", "h", (_worker("w1", 0),)) is None
