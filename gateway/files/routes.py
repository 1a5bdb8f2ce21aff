"""``/v1/files``: OpenAI's Files API routes. Authenticated like the completion routes, but no inference:
they count no quota unit and write no ledger row."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from flatfare.gateway.deps import CurrentCaller
from flatfare.gateway.errors import ERROR_RESPONSES, APIError
from flatfare.gateway.files.protocol import UPLOAD_PURPOSES, FileDeleted, FileList, FileObject
from flatfare.gateway.files.service import FileService
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/v1", tags=["files"], responses=ERROR_RESPONSES)


async def _files(request: Request) -> FileService:
    return services_of(request).files


FilesDep = Annotated[FileService, Depends(_files)]

# The body is read as it streams (gateway/files/upload.py), not by FastAPI; this documents it.
_UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    }}}}}}


@router.post("/files", openapi_extra=_UPLOAD_BODY)
async def upload_file(request: Request, caller: CurrentCaller, files: FilesDep) -> FileObject:
    """Upload a file (multipart: ``file``, ``purpose``, optional ``expires_after``)."""
    length = request.headers.get("content-length")
    try:
        return await files.upload(caller.account_id, request.stream(), request.headers.get("content-type", ""),
                                  int(length) if length and length.isdigit() else None)
    except ClientDisconnect:
        # The client's fault, not the platform's (no 500): nothing was stored, the spool went with it.
        raise APIError(400, "The upload ended before its body did.", param="file", code="upload_incomplete") from None


@router.get("/files")
async def list_files(caller: CurrentCaller, files: FilesDep, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, after: str | None = None,
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    """The account's files, newest first unless ``order=asc``; page on with ``after`` (a file id)."""
    return await files.list(caller.account_id, purpose=purpose, limit=limit, after=after, order=order)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, caller: CurrentCaller, files: FilesDep) -> FileObject:
    return await files.get(caller.account_id, file_id)


@router.get("/files/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                 "format": "binary"}}}}})
async def file_content(file_id: str, caller: CurrentCaller, files: FilesDep) -> StreamingResponse:
    """The file's bytes, streamed."""
    stored, chunks = await files.content(caller.account_id, file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={
        "content-length": str(stored.bytes),
        "content-disposition": f"attachment; filename*=UTF-8''{quote(stored.filename, safe='')}"})


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, caller: CurrentCaller, files: FilesDep) -> FileDeleted:
    return await files.delete(caller.account_id, file_id)
