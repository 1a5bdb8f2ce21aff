"""An instant OpenAI-compatible upstream: what LiteLLM's proxy forwards to, and the "direct" baseline.

``python -m bench.upstream --port P`` serves ``/v1/chat/completions`` and ``/v1/completions`` with
exactly the bytes Flatfare's instant engine (``workers/instant.py``) produces, so both platforms
relay the same answers. aiohttp's server keeps its own cost small and steady.
"""

from __future__ import annotations

import argparse
import os

import orjson
from aiohttp import web

from flatfare.contract import Endpoint
from flatfare.workers.instant import InstantEngine


def create_app(tokens: int) -> web.Application:
    engine = InstantEngine(tokens=tokens)

    async def answer(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        result = await engine.run(endpoint, body)
        if result.body is not None:
            return web.Response(body=result.body.encode(), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        async for event in result.stream:
            await response.write(event.encode())
        await response.write_eof()
        return response

    async def chat(request: web.Request) -> web.StreamResponse:
        return await answer(request, Endpoint.CHAT)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await answer(request, Endpoint.COMPLETION)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "instant", "object": "model", "owned_by": "bench"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def traces(request: web.Request) -> web.Response:
        # An OTLP/HTTP collector that keeps nothing: where a traced benchmark's spans go (bench.overhead).
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/traces", traces)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=int(os.environ.get("FLATFARE_INSTANT_TOKENS", "16")))
    args = parser.parse_args()
    try:
        import uvloop  # type: ignore[import-not-found]

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    web.run_app(create_app(args.tokens), host="127.0.0.1", port=args.port, print=None, access_log=None,
                loop=loop_factory() if loop_factory else None)


if __name__ == "__main__":
    main()
