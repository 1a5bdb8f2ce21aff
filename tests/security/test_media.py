"""Media URLs the worker must not fetch, and images it must not decode, are refused by validation:
a 400 naming the part, within 100 ms. Host names go through :class:`flatfare.gateway.openai.screen.RequestScreen`
(the running loop's resolver, a real Redis for the grammar budget)."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from flatfare.contract import Endpoint
from flatfare.gateway.openai import media
from flatfare.gateway.openai.kinds import parse_body
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.image_size import image_size
from flatfare.gateway.openai.screen import RequestScreen
from tests.security.timing import fast, fast_async

PARAM = "messages[0].content[1].image_url.url"


@pytest.fixture(autouse=True, scope="module")
def _no_full_collections() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def with_image(url: Any, key: str = "image_url") -> dict[str, Any]:
    part = {"type": key, key: {"url": url}}
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}


def refusal(body: dict[str, Any]) -> APIError:
    raw = orjson.dumps(body)

    def attempt() -> APIError:
        with pytest.raises(APIError) as caught:
            parse_body(Endpoint.CHAT, raw)
        return caught.value

    error = fast(attempt)
    assert error.status == 400
    return error


def png(width: int, height: int) -> bytes:
    """A valid PNG header for ``width`` x ``height`` and one compressed row: a bomb when it is large."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1)))
            + chunk(b"IEND", b""))


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


# -- schemes, hosts, addresses --------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "file:///etc/passwd",
    "FILE:///proc/self/environ",
    "gopher://example.com/",
    "ftp://example.com/a.png",
    "//example.com/a.png",
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
    "http://[fd00:ec2::254]/latest/meta-data/",  # AWS's IPv6 metadata (ULA)
    "http://127.0.0.1:6379/",
    "http://10.0.0.5/a.png",
    "http://172.16.3.4/a.png",
    "http://192.168.1.1/a.png",
    "http://100.64.0.1/a.png",  # CGNAT
    "http://0.0.0.0/a.png",
    "http://224.0.0.1/a.png",  # multicast
    "http://240.0.0.1/a.png",  # reserved
    "http://[::1]/a.png",
    "http://[fe80::1%25eth0]/a.png",  # link-local with a zone
    "http://[::ffff:127.0.0.1]/a.png",  # IPv4-mapped
    "http://[::ffff:a9fe:a9fe]/a.png",  # 169.254.169.254, mapped, in hex
    "http://[2002:7f00:1::]/a.png",  # 6to4 of 127.0.0.1
    "http://[64:ff9b::a9fe:a9fe]/a.png",  # NAT64 of 169.254.169.254
    "http://2130706433/a.png",  # 127.0.0.1 as one number
    "http://0x7f.1/a.png",
    "http://0177.0.0.1/a.png",
    "http://127.1/a.png",
    "http://localhost/a.png",
    "http://LOCALHOST./a.png",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://printer.local/a.png",
    "http://intranet/a.png",  # a single label: a search-domain name
    "http://example.com@127.0.0.1/a.png",  # user info: parsers disagree about the host
    "http://127.0.0.1\\@example.com/a.png",
    "http://example.com /a.png",
    "http://example.com:99999/a.png",
    "https:///a.png",
])
def test_urls_the_worker_must_not_fetch(url: str) -> None:
    error = refusal(with_image(url))
    assert (error.param, error.code) == (PARAM, "invalid_image_url")


def test_audio_and_video_urls_are_held_to_the_same_rules() -> None:
    error = refusal(with_image("http://169.254.169.254/", key="video_url"))
    assert (error.param, error.code) == ("messages[0].content[1].video_url.url", "invalid_video_url")
    body = with_image("x")
    body["messages"][0]["content"][1] = {"type": "audio_url", "audio_url": "file:///dev/zero"}
    assert refusal(body).param == "messages[0].content[1].audio_url"


def test_public_urls_pass_validation() -> None:
    for url in ("https://upload.wikimedia.org/a.png", "http://8.8.8.8/a.png", "https://[2606:4700::1111]/a.png",
                "https://example.com:8443/a.png?x=1&y=%20#frag"):
        parse_body(Endpoint.CHAT, orjson.dumps(with_image(url)))


def test_too_many_media_items() -> None:
    body = with_image("https://example.com/a.png")
    body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}] * 65
    assert refusal(body).code == "too_many_media_items"


# -- inline images ----------------------------------------------------------------------------------

def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = png(100_000, 100_000)  # 10 gigapixels, 300 bytes
    assert len(bomb) < 1000
    error = refusal(with_image(data_url(bomb)))
    assert (error.param, error.code) == (PARAM, "image_too_large")


@pytest.mark.parametrize(("url", "code"), [
    ("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "invalid_image_format"),
    ("data:text/html;base64,PGh0bWw+", "invalid_image_format"),
    ("data:image/png,raw-bytes", "invalid_image_url"),
    ("data:image/png;base64,!!!notbase64", "invalid_image_format"),
    # A GIF labelled PNG: the engine reads the bytes, not the label.
    ("data:image/png;base64," + base64.b64encode(b"GIF89a\x0a\x00\x0a\x00" + b"\x00" * 20).decode(), None),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_image_format"),
])
def test_inline_images_must_be_images(url: str, code: str | None) -> None:
    body = with_image(url)
    if code is None:
        parse_body(Endpoint.CHAT, orjson.dumps(body))
    else:
        assert refusal(body).code == code


def test_ordinary_inline_images_pass() -> None:
    from PIL import Image

    for fmt in ("PNG", "JPEG", "GIF", "WEBP"):
        buffer = io.BytesIO()
        Image.new("RGB", (640, 480)).save(buffer, fmt)
        size = image_size(buffer.getvalue())
        assert size is not None and (size.width, size.height) == (640, 480)
        parse_body(Endpoint.CHAT, orjson.dumps(with_image(data_url(buffer.getvalue(), f"image/{fmt.lower()}"))))


def test_address_rules() -> None:
    import ipaddress

    for public in ("8.8.8.8", "1.1.1.1", "2606:4700::1111", "2a00:1450::1"):
        assert not media.forbidden(ipaddress.ip_address(public))
    for private in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "100.100.100.100", "fc00::1", "fe80::1", "::",
                    "::ffff:10.0.0.1", "192.0.2.1", "198.18.0.1", "255.255.255.255"):
        assert media.forbidden(ipaddress.ip_address(private)), private


# -- host names: RequestScreen ----------------------------------------------------------------------


def refs(*urls: str) -> list[media.MediaRef]:
    return [media.MediaRef(f"messages[0].content[{i}].image_url.url", "image", url) for i, url in enumerate(urls)]


def answering(addresses: dict[str, list[str]], delay_s: float = 0.0):  # noqa: ANN201 - a resolver
    async def resolve(host: str) -> list[str]:
        await asyncio.sleep(delay_s)
        return addresses[host]
    return resolve


async def test_names_that_resolve_to_private_addresses_are_refused(redis) -> None:
    # The DNS answers are the one thing faked here: an attacker's name pointing inside the network.
    screen = RequestScreen(redis, resolver=answering({
        "rebind.attacker.example.net": ["93.184.216.34", "10.0.0.7"], "ok.example.org": ["93.184.216.34"],
        "v6.attacker.example.net": ["::ffff:169.254.169.254"]}))
    await screen.check_hosts(refs("https://ok.example.org/a.png"))
    for host in ("rebind.attacker.example.net", "v6.attacker.example.net"):
        async def attempt(host: str = host) -> APIError:
            with pytest.raises(APIError) as caught:
                await screen.check_hosts(refs("https://ok.example.org/a.png", f"https://{host}/a.png"))
            return caught.value

        error = await fast_async(attempt)
        assert (error.status, error.param) == (400, "messages[0].content[1].image_url.url")
        assert "not a public address" in error.message


async def test_names_that_do_not_resolve_in_time_are_refused(redis) -> None:
    screen = RequestScreen(redis, resolve_timeout_s=0.05, resolver=answering({"slow.example.net": ["8.8.8.8"]}, 1.0))
    async def attempt() -> None:
        with pytest.raises(APIError, match="did not resolve within"):
            await screen.check_hosts(refs("https://slow.example.net/a.png"))

    await fast_async(attempt)


async def test_the_system_resolver_refuses_names_that_do_not_exist(redis) -> None:
    screen = RequestScreen(redis, resolve_timeout_s=2.0)
    with pytest.raises(APIError, match="does not resolve|did not resolve") as caught:
        await screen.check_hosts(refs("https://no-such-host.flatfare-security-test-zz/a.png"))
    assert caught.value.code == "invalid_image_url"


async def test_a_flood_of_new_schemas_is_refused_and_repeats_are_free(redis) -> None:
    screen = RequestScreen(redis, new_grammars_per_minute=5)
    for i in range(5):
        await screen.check_grammar(1, f"digest-{i}")
    await screen.check_grammar(1, "digest-0")  # seen this minute: free
    await screen.check_grammar(2, "digest-9")  # another account's budget
    async def attempt() -> APIError:
        with pytest.raises(APIError) as caught:
            await screen.check_grammar(1, "digest-5")
        return caught.value

    error = await fast_async(attempt)
    assert (error.status, error.code) == (429, "too_many_new_schemas")
    assert 1 <= int(error.headers["Retry-After"]) <= 61


async def test_the_screen_checks_a_parsed_request(redis) -> None:
    screen = RequestScreen(redis, new_grammars_per_minute=1, resolver=answering({"img.example.org": ["10.1.1.1"]}))
    _, parsed = parse_body(Endpoint.CHAT, orjson.dumps(with_image("https://img.example.org/a.png")))
    with pytest.raises(APIError, match="not a public address"):
        await screen.check(1, parsed)
    schema = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "string"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": schema}
    _, first = parse_body(Endpoint.CHAT, orjson.dumps(body))
    await screen.check(3, first)
    await screen.check(3, first)
    body["response_format"]["json_schema"]["schema"] = {"type": "integer"}
    _, second = parse_body(Endpoint.CHAT, orjson.dumps(body))
    with pytest.raises(APIError) as caught:
        await screen.check(3, second)
    assert caught.value.status == 429
