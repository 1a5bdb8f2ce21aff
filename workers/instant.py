"""A benchmark/test engine: answers every request at once with a fixed number of tokens, no model.

It exists to measure what the platform itself costs (gateway, Redis, worker loop) with the engine's
time taken out, and to test what drives engines (a fleet's sleep and wake commands) without a GPU: it
sleeps and wakes like vLLM's sleep mode, taking as long as it is told to. Never serve it to customers:
its answers are a fixed filler word.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from flatfare.contract import Endpoint
from flatfare.workers.engine import EngineError, EngineResult

FILLER = " token"


class InstantEngine:
    """Streams ``tokens`` chunks per request (``max_tokens`` lowers it), without any delay."""

    def __init__(self, tokens: int = 16, capacity: int = 1024, first_token_delay_s: float = 0.0,
                 token_delay_s: float = 0.0, start_delay_s: float = 0.0, sleep_delay_s: float = 0.0,
                 wake_delay_s: float = 0.0) -> None:
        self.tokens = tokens
        # Tests slow it down to catch a request or a worker in a given state.
        self.first_token_delay_s = first_token_delay_s
        self.token_delay_s = token_delay_s
        self.start_delay_s = start_delay_s
        self.sleep_delay_s = sleep_delay_s
        self.wake_delay_s = wake_delay_s
        # It can always sleep, as a GPU engine started with sleep mode can.
        self.sleep_unavailable = ""
        self.asleep_level = 0
        self.max_model_len = 1 << 20
        self.max_num_seqs = capacity
        # What an operator sees of it in the log and the admin API, like a vLLM engine's effective config.
        self.engine_config: dict[str, Any] = {"engine": "instant", "max_model_len": self.max_model_len,
                                              "max_num_seqs": capacity, "tokens": tokens}
        self._running = 0

    async def start(self) -> None:
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)

    async def sleep(self, level: int) -> None:
        await asyncio.sleep(self.sleep_delay_s)
        self.asleep_level = level

    async def wake_up(self, level: int) -> None:
        await asyncio.sleep(self.wake_delay_s)
        self.asleep_level = 0

    async def run(self, endpoint: Endpoint, body: dict[str, Any], traceparent: str = "") -> EngineResult:
        if self.asleep_level:  # the worker loop claims nothing while asleep: fail loudly if it did
            raise EngineError("the instant engine was asked to run a request while asleep")
        count = min(self.tokens, int(body.get("max_tokens") or body.get("max_completion_tokens") or self.tokens))
        prompt_tokens = 8
        model = body.get("model", "instant")
        created = int(time.time())
        chat = endpoint is Endpoint.CHAT
        rid = ("chatcmpl-" if chat else "cmpl-") + str(body.get("request_id") or uuid.uuid4().hex)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count, "total_tokens": prompt_tokens + count}
        if not body.get("stream"):
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": FILLER * count},
                          "finish_reason": "length", "logprobs": None}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": FILLER * count, "finish_reason": "length", "logprobs": None}
                obj = "text_completion"
            return EngineResult(body=orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                   "choices": [choice], "usage": usage}).decode())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return EngineResult(stream=self._stream(rid, created, model, chat, count, usage, include_usage))

    async def _stream(self, rid: str, created: int, model: str, chat: bool, count: int, usage: dict[str, int],
                      include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._running += 1
        try:
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
            for i in range(count):
                if i and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = i == count - 1
                if chat:
                    choice = {"index": 0, "delta": {"content": FILLER}, "finish_reason": "length" if last else None}
                else:
                    choice = {"index": 0, "text": FILLER, "finish_reason": "length" if last else None}
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                yield "data: " + orjson.dumps(chunk).decode() + "\n\n"
            if include_usage:
                tail = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
                yield "data: " + orjson.dumps(tail).decode() + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._running -= 1

    def unfinished_requests(self) -> int:
        return self._running

    @property
    def errored(self) -> bool:
        return False

    def shutdown(self) -> None:
        return None
