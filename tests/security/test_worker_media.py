"""The worker's half of the media defence, on vLLM's own fetcher: the engine's environment
(workers/engine.py's MEDIA_LIMITS, set by ``Engine.start``) makes vLLM refuse redirects, local files
and images past the pixel bound. A private HTTP server on a free port plays the image host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.security.test_media import png
from flatfare.workers.engine import MEDIA_LIMITS

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: Engine.start sets the environment for the whole process, and vLLM
# reads it. The engine's arguments are bad on purpose, so it stops right after setting it.
_FETCH = r"""
import asyncio, json, os, sys
from flatfare.workers.engine import Engine, EngineError

try:
    asyncio.run(Engine(["--no-such-flag"]).start())
except EngineError:
    pass
from vllm.multimodal.media.connector import MediaConnector

async def main():
    connector, out = MediaConnector(), {"env": {k: os.environ.get(k) for k in sys.argv[2:]}}
    for name, url in (("image", "/ok.png"), ("redirect", "/redirect"), ("bomb", "/bomb.png"),
                      ("file", "file:///etc/hostname")):
        url = url if url.startswith("file:") else sys.argv[1] + url
        try:
            image = await connector.fetch_image_async(url)
            out[name] = f"loaded {image.size}"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def image_host() -> Iterator[tuple[str, Counter[str]]]:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 16)).save(buffer, "PNG")
    files = {"/ok.png": buffer.getvalue(), "/bomb.png": png(8000, 5000)}  # 40 Mpx: past the bound
    hits: Counter[str] = Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits[self.path] += 1
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/ok.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = files.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()


def test_vllm_fetches_no_redirect_no_file_and_no_bomb(image_host) -> None:
    base, hits = image_host
    env = {k: v for k, v in os.environ.items() if k not in MEDIA_LIMITS}
    env.update({"PYTHONPATH": str(REPO), "VLLM_NO_USAGE_STATS": "1", "NO_PROXY": "127.0.0.1",
                "VLLM_MEDIA_FETCH_MAX_RETRIES": "1"})
    done = subprocess.run([sys.executable, "-c", _FETCH, base, *MEDIA_LIMITS], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["env"] == MEDIA_LIMITS
    assert out["image"] == "loaded (32, 16)"  # the fetcher works
    assert not out["redirect"].startswith("loaded") and hits["/ok.png"] == 1  # the redirect was not followed
    assert "exceed the maximum of 33177600 pixels" in out["bomb"]
    assert "allowed-local-media-path" in out["file"]
