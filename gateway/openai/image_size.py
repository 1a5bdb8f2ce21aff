"""An image's format and pixel size read from its header, without decoding a single pixel.

The gateway checks inline (``data:``) images before they reach a worker, where decoding a
decompression bomb (a few kilobytes of PNG that inflate to gigabytes) would cost the engine host's
memory. Only the four formats OpenAI accepts are recognised: PNG, JPEG, GIF and WebP.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field.
_JPEG_STANDALONE = frozenset((0x01, *range(0xD0, 0xD9)))


@dataclass(frozen=True, slots=True)
class ImageSize:
    format: str  # "png", "jpeg", "gif" or "webp"
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def image_size(data: bytes) -> ImageSize | None:
    """The format and size the header declares, or None when the bytes are none of the four formats
    (or the header is cut short)."""
    try:
        if data.startswith(_PNG):
            return _png(data)
        if data.startswith(b"\xff\xd8"):
            return _jpeg(data)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack_from("<HH", data, 6)
            return ImageSize("gif", width, height)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
    except (struct.error, IndexError):  # a header shorter than it claims
        return None
    return None


def _png(data: bytes) -> ImageSize | None:
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", data, 16)
    return ImageSize("png", width, height)


def _jpeg(data: bytes) -> ImageSize | None:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_STANDALONE:
            at += 2
            continue
        if marker == 0xD9:  # end of image before any frame
            return None
        (length,) = struct.unpack_from(">H", data, at + 2)
        if marker in _JPEG_SOF:
            height, width = struct.unpack_from(">HH", data, at + 5)
            return ImageSize("jpeg", width, height)
        at += 2 + length
    return None


def _webp(data: bytes) -> ImageSize | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: a 14-bit size after the key frame's start code
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack_from("<HH", data, 26)
        return ImageSize("webp", width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L":  # lossless: 14 bits each, minus one, after the 0x2f signature
        if data[20] != 0x2F:
            return None
        (bits,) = struct.unpack_from("<I", data, 21)
        return ImageSize("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X" and len(data) >= 30:  # extended: 24 bits each, minus one, of the canvas
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return ImageSize("webp", width, height)
    return None
