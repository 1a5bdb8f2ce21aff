"""The Files API's rules: uploads checked and stored within the account's caps, files listed, read,
streamed and deleted by their owner only, expired files swept. Knows nothing of HTTP beyond the
gateway's error type; the bytes go through a :class:`~flatfare.gateway.files.storage.FileStore`."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import string
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import anyio.to_thread
from sqlalchemy import and_, delete, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.errors import APIError, invalid
from flatfare.gateway.files.batch_input import BadBatchLine, check_batch_file
from flatfare.gateway.files.protocol import UPLOAD_PURPOSES, FileDeleted, FileList, FileObject
from flatfare.gateway.files.storage import CHUNK_BYTES, FileStore, ObjectMissing, StoreError
from flatfare.gateway.files.upload import BadUpload, UploadTooLarge, receive_upload
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import StoredFile

log = logging.getLogger("flatfare.gateway.files")

# OpenAI's bounds on expires_after, and its default for batch files (others are kept until deleted).
MIN_TTL_S, MAX_TTL_S = 3600, 30 * 86400
BATCH_TTL = timedelta(days=30)
# A multipart body is its file plus a few small fields and boundaries: room for those.
FORM_SLACK_BYTES = 64 * 1024
SWEEP_BATCH = 500
_ID_ALPHABET = string.ascii_letters + string.digits

_ENSURE_USAGE = text("INSERT INTO file_usage (account_id, files, bytes) VALUES (:account, 0, 0) "
                     "ON CONFLICT (account_id) DO NOTHING")
# One statement takes the room or refuses, so concurrent uploads (any gateway process) never pass a cap.
_TAKE_ROOM = text("UPDATE file_usage SET files = files + 1, bytes = bytes + :bytes WHERE account_id = :account "
                  "AND files + 1 <= :max_files AND bytes + :bytes <= :max_bytes")
_GIVE_ROOM = text("UPDATE file_usage SET files = files - 1, bytes = bytes - :bytes WHERE account_id = :account")
_USAGE = text("SELECT files, bytes FROM file_usage WHERE account_id = :account")


@dataclass(frozen=True, slots=True)
class FileLimits:
    max_bytes: int
    account_max_bytes: int
    account_max_files: int


def new_file_id() -> str:
    return "file-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def object_key(account_id: int, file_id: str) -> str:
    return f"{account_id}/{file_id}"


def public(row: StoredFile) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at.timestamp()), filename=row.filename,
                      purpose=row.purpose, expires_at=int(row.expires_at.timestamp()) if row.expires_at else None)


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id[:80]}", param="file_id", code="file_not_found")


def _store_down(exc: StoreError) -> APIError:
    log.warning("file store unavailable: %s", exc)
    return APIError(503, "The platform's file store is unreachable; retry shortly.", code="file_store_unavailable",
                    headers={"Retry-After": "1"})


def _live(now: datetime):  # noqa: ANN202 - a SQL expression
    return or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > now)


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):g} MiB"


class FileService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], store: FileStore, limits: FileLimits,
                 spool_dir: Path | None = None) -> None:
        self._sessions = sessions
        self.store = store
        self.limits = limits
        self._spool_dir = spool_dir

    # -- upload ----------------------------------------------------------------------------------

    async def upload(self, account_id: int, body: AsyncIterator[bytes], content_type: str,
                     content_length: int | None) -> FileObject:
        """``POST /v1/files``: the form streamed to a spool file within the size cap, checked (a batch
        file line by line), stored and recorded within the account's caps."""
        if content_length is not None and content_length > self.limits.max_bytes + FORM_SLACK_BYTES:
            raise self._too_large()
        await self.sweep(account_id=account_id)  # expired files give their room back first
        await self._check_room(account_id, 0)
        with self._spool() as spool:
            try:
                upload = await receive_upload(body, content_type, spool, self.limits.max_bytes)
            except UploadTooLarge:
                raise self._too_large() from None
            except BadUpload as exc:
                code = "missing_required_parameter" if exc.param == "file" else "invalid_value"
                raise invalid(str(exc), exc.param, code) from None
            purpose = self._purpose(upload.fields)
            expires_at = self._expiry(upload.fields, purpose, datetime.now(UTC))
            if purpose == "batch":
                try:
                    await anyio.to_thread.run_sync(_check_batch_spool, spool)
                except BadBatchLine as exc:
                    raise invalid(f"The batch file is invalid. {exc}", "file", "invalid_batch_file") from None
            return await self.create(account_id, upload.filename or "upload", purpose, _read_chunks(spool),
                                     expires_at=expires_at)

    async def create(self, account_id: int, filename: str, purpose: str, chunks: AsyncIterable[bytes], *,
                     expires_at: datetime | None = None) -> FileObject:
        """Store a file for the account (an upload, or a batch's output) and record it, within the
        account's caps; refused, it leaves nothing behind."""
        file_id = new_file_id()
        key = object_key(account_id, file_id)
        size = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in chunks:
                size += len(chunk)
                yield chunk

        try:
            await self.store.put(key, counted())
        except StoreError as exc:
            raise _store_down(exc) from None
        row = StoredFile(id=file_id, account_id=account_id, filename=os.path.basename(filename)[:255] or "upload",
                         purpose=purpose, bytes=size, created_at=datetime.now(UTC), expires_at=expires_at)
        try:
            async with self._sessions() as session, session.begin():
                await session.execute(_ENSURE_USAGE, {"account": account_id})
                took = await session.execute(_TAKE_ROOM, {
                    "account": account_id, "bytes": size, "max_files": self.limits.account_max_files,
                    "max_bytes": self.limits.account_max_bytes})
                if took.rowcount != 1:
                    raise await self._cap_error(session, account_id, size)
                session.add(row)
        except BaseException:
            with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
                await self.store.delete(key)
            raise
        log.info("file stored", extra={"file_id": file_id, "account": account_id, "bytes": size, "purpose": purpose})
        return public(row)

    def _too_large(self) -> APIError:
        return APIError(413, f"The file is larger than the {_mib(self.limits.max_bytes)} a file may be.",
                        param="file", code="request_too_large")

    async def _check_room(self, account_id: int, size: int) -> None:
        async with self._sessions() as session:
            usage = (await session.execute(_USAGE, {"account": account_id})).first()
            if usage is not None and (usage.files + 1 > self.limits.account_max_files
                                      or usage.bytes + size > self.limits.account_max_bytes):
                raise await self._cap_error(session, account_id, size)

    async def _cap_error(self, session: AsyncSession, account_id: int, size: int) -> APIError:
        files, stored = (await session.execute(_USAGE, {"account": account_id})).one()
        if files + 1 > self.limits.account_max_files:
            return APIError(400, f"The account keeps {files} files, the most it may; delete some "
                            "(DELETE /v1/files/{file_id}) before uploading more.", code="too_many_files")
        return APIError(400, f"The account keeps {_mib(stored)} of files and may keep "
                        f"{_mib(self.limits.account_max_bytes)}; this file ({_mib(size)}) does not fit. Delete "
                        "some files first.", param="file", code="storage_limit_exceeded")

    @staticmethod
    def _purpose(fields: dict[str, str]) -> str:
        purpose = fields.get("purpose")
        if not purpose:
            raise invalid("The form has no 'purpose'.", "purpose", "missing_required_parameter")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid(f"Flatfare takes files of purpose {' or '.join(map(repr, UPLOAD_PURPOSES))}, not "
                          f"'{purpose[:64]}': it has no API that reads other files.", "purpose")
        return purpose

    @staticmethod
    def _expiry(fields: dict[str, str], purpose: str, now: datetime) -> datetime | None:
        anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return now + BATCH_TTL if purpose == "batch" else None
        if anchor != "created_at":
            raise invalid("expires_after's anchor must be 'created_at'.", "expires_after.anchor")
        try:
            ttl = int(seconds or "")
        except ValueError:
            ttl = 0
        if not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise invalid(f"expires_after's seconds must be an integer from {MIN_TTL_S} to {MAX_TTL_S}.",
                          "expires_after.seconds")
        return now + timedelta(seconds=ttl)

    @contextlib.contextmanager
    def _spool(self) -> Iterator[Path]:
        handle, name = tempfile.mkstemp(prefix="flatfare-upload-", dir=self._spool_dir)
        os.close(handle)
        try:
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)

    # -- reading and deleting --------------------------------------------------------------------

    async def list(self, account_id: int, *, purpose: str | None, limit: int, after: str | None,
                   order: str) -> FileList:
        now = datetime.now(UTC)
        query = select(StoredFile).where(StoredFile.account_id == account_id, _live(now))
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        ascending = order == "asc"
        async with self._sessions() as session:
            if after is not None:
                anchor = await session.get(StoredFile, after)
                if anchor is None or anchor.account_id != account_id:
                    raise invalid(f"No file '{after[:80]}' to list after.", "after")
                later = StoredFile.created_at > anchor.created_at if ascending else StoredFile.created_at < anchor.created_at
                tie = StoredFile.id > anchor.id if ascending else StoredFile.id < anchor.id
                query = query.where(or_(later, and_(StoredFile.created_at == anchor.created_at, tie)))
            columns = (StoredFile.created_at, StoredFile.id)
            query = query.order_by(*(c.asc() if ascending else c.desc() for c in columns)).limit(limit + 1)
            rows = list((await session.execute(query)).scalars())
        data = [public(row) for row in rows[:limit]]
        return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                        has_more=len(rows) > limit)

    async def _row(self, session: AsyncSession, account_id: int, file_id: str) -> StoredFile:
        row = (await session.execute(select(StoredFile).where(
            StoredFile.id == file_id, StoredFile.account_id == account_id, _live(datetime.now(UTC))))).scalar()
        if row is None:
            raise _not_found(file_id)
        return row

    async def get(self, account_id: int, file_id: str) -> FileObject:
        async with self._sessions() as session:
            return public(await self._row(session, account_id, file_id))

    async def content(self, account_id: int, file_id: str) -> tuple[FileObject, AsyncIterator[bytes]]:
        """The file and its bytes as a stream, opened (a missing object is found before any byte goes)."""
        async with self._sessions() as session:
            row = await self._row(session, account_id, file_id)
        try:
            return public(row), await self.store.get(object_key(account_id, file_id))
        except ObjectMissing:
            log.error("file %s has a row but no object in the store", file_id)
            raise _not_found(file_id) from None
        except StoreError as exc:
            raise _store_down(exc) from None

    async def delete(self, account_id: int, file_id: str) -> FileDeleted:
        async with self._sessions() as session, session.begin():
            row = await self._row(session, account_id, file_id)
            if not await self._forget(session, row):
                raise _not_found(file_id)
        await self._drop_object(row)
        return FileDeleted(id=file_id, deleted=True)

    @staticmethod
    async def _forget(session: AsyncSession, row: StoredFile) -> bool:
        """Delete the row and give its room back, once, whoever (a client, a sweeper) gets there first."""
        gone = await session.execute(delete(StoredFile).where(StoredFile.id == row.id))
        if gone.rowcount != 1:
            return False
        await session.execute(_GIVE_ROOM, {"account": row.account_id, "bytes": row.bytes})
        return True

    async def _drop_object(self, row: StoredFile) -> None:
        # The row is gone first: a failure here leaves bytes no one can reach or is charged for, never a
        # listed file without its bytes.
        try:
            await self.store.delete(object_key(row.account_id, row.id))
        except StoreError as exc:
            log.warning("file %s deleted, its object not: %s", row.id, exc)

    # -- expiry ----------------------------------------------------------------------------------

    async def sweep(self, now: datetime | None = None, account_id: int | None = None) -> int:
        """Delete files past their expiry (the account's only, if given): rows, counts, then bytes."""
        now = now or datetime.now(UTC)
        query = select(StoredFile).where(StoredFile.expires_at <= now).limit(SWEEP_BATCH)
        if account_id is not None:
            query = query.where(StoredFile.account_id == account_id)
        async with self._sessions() as session:
            expired = list((await session.execute(query)).scalars())
        swept = 0
        for row in expired:
            async with self._sessions() as session, session.begin():
                forgotten = await self._forget(session, row)
            if forgotten:
                await self._drop_object(row)
                swept += 1
        return swept


def _check_batch_spool(path: Path) -> None:
    with path.open("rb") as lines:
        check_batch_file(lines)


async def _read_chunks(path: Path) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as source:
        while chunk := await source.read(CHUNK_BYTES):
            yield chunk
