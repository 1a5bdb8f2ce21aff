"""Which media a chat request may carry: the gateway's half of the SSRF and image-bomb defence.

vLLM, on the worker, fetches the ``image_url`` (``audio_url``, ``video_url``) of a message itself.
So the gateway refuses, before anything is counted, every URL the worker must not fetch: schemes
other than https, http and data; hosts that are (or, once :mod:`flatfare.gateway.openai.screen` resolves them,
resolve to) private, loopback, link-local, CGNAT, multicast, reserved or otherwise non-global
addresses; names that only mean something inside a network (``localhost``, ``*.internal``, single
labels); and URLs that two parsers could read differently (user info, backslashes, spaces). Inline
``data:`` images must be PNG, JPEG, GIF or WebP whose header declares at most
:data:`MAX_IMAGE_PIXELS`. The worker does not follow redirects (workers/engine.py), so a public URL
cannot lead its fetch somewhere private.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flatfare.gateway.errors import APIError, invalid
from flatfare.gateway.openai.image_size import image_size

# Media parts in one request (OpenAI allows many more; each one is a fetch and a decode on the worker).
MAX_MEDIA_PARTS = 64
MAX_URL_CHARS = 4096
# One inline (base64) item; the body limit bounds them together.
MAX_DATA_URL_CHARS = 16 * 1024 * 1024
# 7680 x 4320 (8K). The worker refuses larger fetched images with the same bound (VLLM_MAX_IMAGE_PIXELS
# in workers/engine.py).
MAX_IMAGE_PIXELS = 33_177_600
IMAGE_TYPES = frozenset(("image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp"))
_KINDS = {"image_url": "image", "audio_url": "audio", "video_url": "video"}
_SCHEMES = frozenset(("http", "https"))
# RFC 3986's characters: anything else (spaces, backslashes, controls, non-ASCII) is a chance for the
# gateway's parser and the worker's (urllib3) to disagree about the host.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+")
# 127.1, 0x7f.0.0.1, 2130706433, 0177.0.0.1: IPv4 in forms resolvers accept and ipaddress does not.
_NUMERIC_HOST = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}")
_LOCAL_SUFFIXES = (".localhost", ".local", ".localdomain", ".internal", ".intranet", ".lan", ".home.arpa",
                   ".corp", ".private", ".test", ".invalid", ".example")
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media URL of a request: where it is (OpenAI's ``param``), what it should be, the URL."""

    param: str
    kind: str  # "image", "audio" or "video"
    url: str

    def refuse(self, why: str, code: str | None = None) -> APIError:
        return invalid(f"{self.param}: {why}", param=self.param, code=code or f"invalid_{self.kind}_url")


def media_refs(messages: list[Any]) -> list[MediaRef]:
    """Every media URL in the messages' content parts (refused past :data:`MAX_MEDIA_PARTS`)."""
    refs = list(_refs(messages))
    if len(refs) > MAX_MEDIA_PARTS:
        raise invalid(f"The messages carry {len(refs)} images, audio or video items; at most {MAX_MEDIA_PARTS} "
                      "are allowed per request.", param="messages", code="too_many_media_items")
    return refs


def _refs(messages: list[Any]) -> Iterator[MediaRef]:
    for m, message in enumerate(messages):
        content = getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            for key, kind in _KINDS.items():
                value = part.get(key)
                base = f"messages[{m}].content[{p}].{key}"
                if isinstance(value, dict):
                    url = value.get("url")
                    if url is not None:
                        yield MediaRef(f"{base}.url", kind, url)
                elif value is not None:
                    yield MediaRef(base, kind, value)


def check_media(ref: MediaRef) -> str | None:
    """Refuse a URL the worker must not fetch; return the host name still to resolve (None for a
    ``data:`` URL or an IP address, which need nothing more)."""
    if _is_data(ref):
        _check_data_url(ref)
        return None
    return host_of(ref)


def host_of(ref: MediaRef) -> str | None:
    """The host name of an http(s) URL, still to resolve; None for a ``data:`` URL or an IP address.
    Refuses what :func:`check_media` refuses of a URL's text."""
    if _is_data(ref):
        return None
    url = ref.url
    if len(url) > MAX_URL_CHARS:
        raise ref.refuse(f"the URL is longer than {MAX_URL_CHARS} characters.")
    if not _URL_CHARS.fullmatch(url):
        raise ref.refuse("the URL has characters outside RFC 3986 (spaces, backslashes, non-ASCII); "
                         "percent-encode them.")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        shown = f"'{scheme}:'" if scheme else "no scheme"
        raise ref.refuse(f"the URL has {shown}; only https, http and data URLs are accepted.")
    if "@" in parts.netloc:
        raise ref.refuse("URLs with user info ('user@host') are not accepted.")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        raise ref.refuse("the URL's port is not a number from 0 to 65535.") from None
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ref.refuse("the URL has no host.")
    address = _ip(host)
    if address is not None:
        check_address(ref, address)
        return None
    if _NUMERIC_HOST.fullmatch(host):
        raise ref.refuse("write an IP address host in its usual dotted form.")
    if "." not in host or host == "localhost" or host.endswith(_LOCAL_SUFFIXES):
        raise ref.refuse(f"the host '{host}' is not a public name.")
    return host


def _is_data(ref: MediaRef) -> bool:
    if not isinstance(ref.url, str):
        raise ref.refuse("the URL must be a string.")
    return ref.url[:5].lower() == "data:"


def check_address(ref: MediaRef, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if forbidden(address):
        raise ref.refuse(f"the host is (or resolves to) {address}, which is not a public address.")


def forbidden(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for every address a fetch on the platform's behalf must not reach."""
    if isinstance(address, ipaddress.IPv6Address):
        for embedded in _embedded_ipv4(address):
            if forbidden(embedded):
                return True
    return (not address.is_global or address.is_private or address.is_loopback or address.is_link_local
            or address.is_multicast or address.is_reserved or address.is_unspecified
            or (isinstance(address, ipaddress.IPv4Address) and address in _CGNAT))


def _embedded_ipv4(address: ipaddress.IPv6Address) -> Iterator[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one leads to: mapped, 6to4, Teredo, NAT64."""
    if address.ipv4_mapped is not None:
        yield address.ipv4_mapped
    if address.sixtofour is not None:
        yield address.sixtofour
    if address.teredo is not None:
        yield from address.teredo
    if address in _NAT64:
        yield ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _check_data_url(ref: MediaRef) -> None:
    url = ref.url
    if len(url) > MAX_DATA_URL_CHARS:
        raise ref.refuse(f"the data URL is longer than {MAX_DATA_URL_CHARS} characters.", code="media_too_large")
    header, comma, data = url[5:].partition(",")
    media_type, _, encoding = header.rpartition(";")
    media_type = media_type.partition(";")[0].strip().lower()
    if not comma or encoding.strip().lower() != "base64":
        raise ref.refuse("data URLs must be base64: 'data:<media type>;base64,<data>'.")
    if ref.kind != "image":
        if not media_type.startswith(ref.kind + "/"):
            raise ref.refuse(f"the data URL's media type is '{media_type}', not {ref.kind}/*.")
        return
    if media_type not in IMAGE_TYPES:
        raise ref.refuse(f"the data URL's media type is '{media_type}'; send image/png, image/jpeg, image/gif "
                         "or image/webp.", code="invalid_image_format")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ref.refuse("the data URL is not valid base64.", code="invalid_image_format") from None
    size = image_size(raw)
    if size is None:
        raise ref.refuse("the data is not a PNG, JPEG, GIF or WebP image.", code="invalid_image_format")
    if size.width == 0 or size.height == 0 or size.pixels > MAX_IMAGE_PIXELS:
        raise ref.refuse(f"the image declares {size.width} x {size.height} pixels; images of 1 to "
                         f"{MAX_IMAGE_PIXELS} pixels (7680 x 4320) are accepted.", code="image_too_large")
