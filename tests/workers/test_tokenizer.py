"""The worker publishes its model's tokenizer for the gateways (real Redis): from the prepared folder,
once per content, again after Redis lost it, and never at the cost of serving when Redis is away."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from flatfare import contract
from flatfare.redis_conn import connect
from flatfare.redis_local import free_port
from flatfare.workers.tokenizer import digest_of, keep_published, publish_tokenizer, tokenizer_json
from tests.conftest import VISIBLE_WITHIN_S

MODEL = "m"
TEXT = '{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}'


def test_the_prepared_folders_tokenizer_json_is_published_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(TEXT, encoding="utf-8")
    assert tokenizer_json(str(tmp_path)) == TEXT


async def test_published_once_per_content_and_again_after_redis_lost_it(redis) -> None:
    key = contract.tokenizer_key(MODEL)
    assert await publish_tokenizer(redis, MODEL, TEXT)
    assert await redis.hgetall(key) == {contract.TOKENIZER_DIGEST.encode(): digest_of(TEXT).encode(),
                                        contract.TOKENIZER_JSON.encode(): TEXT.encode()}
    assert not await publish_tokenizer(redis, MODEL, TEXT)
    keeper = asyncio.create_task(keep_published(redis, MODEL, TEXT, every_s=0.05))
    try:
        await redis.flushall()
        deadline = time.monotonic() + VISIBLE_WITHIN_S
        while await redis.hget(key, contract.TOKENIZER_JSON) != TEXT.encode():
            assert time.monotonic() < deadline, "the tokenizer was not published again"
            await asyncio.sleep(0.05)
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)


async def test_a_redis_away_is_logged_not_raised() -> None:
    away = connect(f"redis://127.0.0.1:{free_port()}")
    try:
        assert not await publish_tokenizer(away, MODEL, TEXT)
    finally:
        await away.aclose()
