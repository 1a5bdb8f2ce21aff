"""Where the Files API keeps the files' bytes: a local folder or an S3-compatible bucket, behind one small
interface. Keys are ``{account_id}/{file_id}``; the metadata lives in SQL (``files``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread

from flatfare.gateway.settings import GatewaySettings

CHUNK_BYTES = 256 * 1024
# S3 multipart parts: every part but the last must be at least 5 MiB.
PART_BYTES = 8 * 1024 * 1024


class StoreError(Exception):
    """The file store failed (unreachable, refused); the request gets 503."""


class ObjectMissing(StoreError):
    """No object under that key."""


class FileStore(Protocol):
    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> None:
        """Store the stream under ``key``, whole or not at all."""

    async def get(self, key: str) -> AsyncIterator[bytes]:
        """Open the object (:class:`ObjectMissing` if absent) and return its bytes as a stream."""

    async def delete(self, key: str) -> None:
        """Remove the object; an absent one is no error."""

    async def exists(self, key: str) -> bool: ...


class LocalStore:
    """A folder every gateway process sees (one host, or a shared volume). A put writes a temporary file
    beside its target and renames it into place, so a reader never sees half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> None:
        path = self._path(key)
        await anyio.to_thread.run_sync(lambda: path.parent.mkdir(parents=True, exist_ok=True))
        staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            async with await anyio.open_file(staging, "wb") as out:
                async for chunk in chunks:
                    await out.write(chunk)
            await anyio.to_thread.run_sync(os.replace, staging, path)
        except BaseException:
            await anyio.to_thread.run_sync(lambda: staging.unlink(missing_ok=True))
            raise

    async def get(self, key: str) -> AsyncIterator[bytes]:
        try:
            source = await anyio.open_file(self._path(key), "rb")
        except FileNotFoundError:
            raise ObjectMissing(key) from None

        async def stream() -> AsyncIterator[bytes]:
            async with source:
                while chunk := await source.read(CHUNK_BYTES):
                    yield chunk

        return stream()

    async def delete(self, key: str) -> None:
        await anyio.to_thread.run_sync(lambda: self._path(key).unlink(missing_ok=True))

    async def exists(self, key: str) -> bool:
        return await anyio.to_thread.run_sync(self._path(key).is_file)


class S3Store:
    """A bucket of any S3-compatible store through boto3, whose blocking calls run in worker threads (a
    boto3 client is thread-safe). Objects over one part are sent as multipart uploads, a part at a
    time, so an upload holds at most one part in memory."""

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        self._s3 = client
        self.bucket = bucket
        self.prefix = prefix

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> S3Store:
        import boto3  # a few hundred ms to import: only a gateway configured for S3 pays them

        secret = settings.files_s3_secret_access_key.get_secret_value()
        client = boto3.client("s3", endpoint_url=settings.files_s3_endpoint_url or None,
                              region_name=settings.files_s3_region or None,
                              aws_access_key_id=settings.files_s3_access_key_id or None,
                              aws_secret_access_key=secret or None)
        return cls(client, settings.files_s3_bucket, settings.files_s3_prefix)

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    async def _call(self, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return await anyio.to_thread.run_sync(lambda: getattr(self._s3, method)(**kwargs))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectMissing(kwargs.get("Key", "")) from exc
            raise StoreError(f"S3 {method} failed: {code or exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"S3 {method} failed: {exc}") from exc

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> None:
        target = {"Bucket": self.bucket, "Key": self._key(key)}
        part = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        try:
            async for chunk in chunks:
                part += chunk
                if len(part) >= PART_BYTES:
                    if upload_id is None:
                        upload_id = (await self._call("create_multipart_upload", **target))["UploadId"]
                    parts.append(await self._send_part(target, upload_id, len(parts) + 1, bytes(part)))
                    part.clear()
            if upload_id is None:
                await self._call("put_object", Body=bytes(part), **target)
                return
            if part:
                parts.append(await self._send_part(target, upload_id, len(parts) + 1, bytes(part)))
            await self._call("complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts},
                             **target)
        except BaseException:
            if upload_id is not None:
                with anyio.CancelScope(shield=True):
                    await self._call("abort_multipart_upload", UploadId=upload_id, **target)
            raise

    async def _send_part(self, target: dict[str, str], upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        sent = await self._call("upload_part", UploadId=upload_id, PartNumber=number, Body=body, **target)
        return {"ETag": sent["ETag"], "PartNumber": number}

    async def get(self, key: str) -> AsyncIterator[bytes]:
        body = (await self._call("get_object", Bucket=self.bucket, Key=self._key(key)))["Body"]

        async def stream() -> AsyncIterator[bytes]:
            try:
                while chunk := await anyio.to_thread.run_sync(body.read, CHUNK_BYTES):
                    yield chunk
            finally:
                body.close()

        return stream()

    async def delete(self, key: str) -> None:
        await self._call("delete_object", Bucket=self.bucket, Key=self._key(key))

    async def exists(self, key: str) -> bool:
        try:
            await self._call("head_object", Bucket=self.bucket, Key=self._key(key))
        except ObjectMissing:
            return False
        return True


def open_store(settings: GatewaySettings) -> FileStore:
    """The store the settings choose."""
    if settings.files_backend == "s3":
        if not settings.files_s3_bucket:
            raise RuntimeError("FLATFARE_FILES_BACKEND=s3 needs FLATFARE_FILES_S3_BUCKET (an existing bucket)")
        return S3Store.from_settings(settings)
    return LocalStore(settings.files_dir or settings.data_dir / "files")
