"""Reading a ``multipart/form-data`` upload as it streams in: the file part goes to a spool file on disk
and is counted as it comes, so an upload past its cap is refused without ever being held whole, in
memory or on disk; the other fields are small and kept."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

FILE_FIELD = "file"
MAX_FIELD_BYTES = 4096
MAX_PARTS = 16


class BadUpload(ValueError):
    """The body is not the form the Files API takes."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UploadTooLarge(Exception):
    """The file passed the cap while it streamed in."""


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Reader:
    """python-multipart's callbacks, collecting what one chunk of the body held."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self.parts = 0
        self.part = _Part()
        self.header_name = b""
        self.header_value = b""
        self.disposition = b""
        self.file_data: list[bytes] = []

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise BadUpload(f"The form has more than {MAX_PARTS} parts.")
        self.part = _Part()
        self.disposition = b""

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]
        if len(self.header_value) > MAX_FIELD_BYTES:
            raise BadUpload("A part's header is too long.")

    def on_header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = self.header_value
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        if b"name" not in options:
            raise BadUpload("Each part of the form needs a Content-Disposition with a name.")
        self.part.name = options[b"name"].decode("utf-8", "replace")
        if self.part.name == FILE_FIELD:
            if self.upload.filename is not None:
                raise BadUpload("Send one file per upload.", FILE_FIELD)
            self.upload.filename = options.get(b"filename", b"").decode("utf-8", "replace") or "upload"

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.name == FILE_FIELD:
            self.file_data.append(data[start:end])
            return
        self.part.data += data[start:end]
        if len(self.part.data) > MAX_FIELD_BYTES:
            raise BadUpload(f"The form field '{self.part.name[:64]}' is longer than {MAX_FIELD_BYTES} bytes.",
                            self.part.name[:64])

    def on_part_end(self) -> None:
        if self.part.name != FILE_FIELD:
            self.upload.fields[self.part.name] = self.part.data.decode("utf-8", "replace")


async def receive_upload(body: AsyncIterator[bytes], content_type: str, spool: Path, max_bytes: int) -> Upload:
    """Read the form from ``body``, writing the file part to ``spool``. Past ``max_bytes`` of file, the rest
    of the body is read and dropped (up to as much again, so the client, still sending, hears the 413)
    and :class:`UploadTooLarge` is raised."""
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise BadUpload("Upload files as multipart/form-data, with the fields 'file' and 'purpose'.")
    upload = Upload()
    reader = _Reader(upload)
    parser = MultipartParser(options[b"boundary"], {
        "on_part_begin": reader.on_part_begin, "on_part_data": reader.on_part_data,
        "on_part_end": reader.on_part_end, "on_header_field": reader.on_header_field,
        "on_header_value": reader.on_header_value, "on_header_end": reader.on_header_end,
        "on_headers_finished": reader.on_headers_finished,
    })
    async with await anyio.open_file(spool, "wb") as out:
        async for chunk in body:
            try:
                parser.write(chunk)
            except FormParserError:
                raise BadUpload("The multipart body is malformed.") from None
            for data in reader.file_data:
                upload.size += len(data)
                if upload.size > max_bytes:
                    await _drain(body, max_bytes)
                    raise UploadTooLarge
                await out.write(data)
            reader.file_data.clear()
    try:
        parser.finalize()
    except FormParserError:
        raise BadUpload("The multipart body ends early.") from None
    if upload.filename is None:
        raise BadUpload("The form has no 'file' part.", FILE_FIELD)
    return upload


async def _drain(body: AsyncIterator[bytes], limit: int) -> None:
    drained = 0
    async for chunk in body:
        drained += len(chunk)
        if drained > limit:
            return
