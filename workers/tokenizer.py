"""The worker's model tokenizer, published once at start so gateways can count a long prompt's tokens
before the request is counted or queued (``contract.tokenizer_key``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.redis_conn import REDIS_DOWN

log = logging.getLogger("flatfare.worker")

# How often a running worker checks that its tokenizer is still published (a Redis that lost its data
# lost it too): one HGET; the tokenizer is written again only when it is missing or another replaced it.
REPUBLISH_EVERY_S = 30.0


def tokenizer_json(model_path: str) -> str | None:
    """The model's ``tokenizer.json`` as text: the prepared folder's file, or, for a hub id or a folder
    without one, the fast tokenizer transformers builds (from the files vLLM already fetched).
    None when the model has no fast tokenizer: gateways then estimate (see the gateway's prompt_length)."""
    file = Path(model_path) / "tokenizer.json"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    try:
        from transformers import AutoTokenizer

        backend = getattr(AutoTokenizer.from_pretrained(model_path), "backend_tokenizer", None)
    except (ImportError, OSError, ValueError) as exc:
        log.warning("no tokenizer to publish for %s (%s): gateways will estimate prompt lengths", model_path, exc)
        return None
    return backend.to_str() if backend is not None else None


def digest_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def publish_tokenizer(redis: aioredis.Redis, model: str, text: str) -> bool:
    """Publish ``text`` as ``model``'s tokenizer unless the same one is there already (replicas start
    together; the file can be megabytes). True if it was written."""
    key = contract.tokenizer_key(model)
    digest = digest_of(text)
    try:
        current = await redis.hget(key, contract.TOKENIZER_DIGEST)
        if current is not None and current.decode() == digest:
            return False
        # One HSET: a reader never sees a digest without its tokenizer.
        await redis.hset(key, mapping={contract.TOKENIZER_DIGEST: digest, contract.TOKENIZER_JSON: text})
    except REDIS_DOWN as exc:
        log.warning("could not publish the tokenizer of %s (%s): gateways will estimate prompt lengths",
                    model, exc.__class__.__name__)
        return False
    return True


async def keep_published(redis: aioredis.Redis, model: str, text: str, every_s: float = REPUBLISH_EVERY_S) -> None:
    """Publish ``text`` again whenever it is gone, until cancelled: after a Redis data loss, gateways
    estimate this model's long prompts only until the next check."""
    while True:
        await asyncio.sleep(every_s)
        if await publish_tokenizer(redis, model, text):
            log.info("published the tokenizer of %s again", model)
