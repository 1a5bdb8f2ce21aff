"""The Files API's wire models, as OpenAI's SDKs read them (``openai.types.FileObject`` and friends)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

# What a client may upload for. OpenAI's other purposes (assistants, fine-tune, vision, evals) feed APIs
# Flatfare does not have; batch_output files are written by batches, never uploaded.
UPLOAD_PURPOSES = ("batch", "user_data")
Purpose = Literal["batch", "batch_output", "user_data"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    # Deprecated at OpenAI, still read by older SDKs: a stored file has been checked, so "processed".
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool
