"""The Batch API's wire models, as OpenAI's SDK sends and reads them."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flatfare.contract import Endpoint
from flatfare.storage.models import Batch

# The routes a batch's lines may call, each the job kind its lines become.
ENDPOINTS = {kind.path: kind for kind in Endpoint}
# OpenAI's bounds on a batch's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, value: str) -> str:
        if value not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(sorted(ENDPOINTS))}")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs")
        if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()):
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}")
        return value


def _seconds(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_object(batch: Batch) -> dict[str, Any]:
    """OpenAI's batch object."""
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _seconds(batch.created_at),
        "in_progress_at": _seconds(batch.in_progress_at),
        "expires_at": _seconds(batch.expires_at),
        "finalizing_at": _seconds(batch.finalizing_at),
        "completed_at": _seconds(batch.completed_at),
        "failed_at": _seconds(batch.failed_at),
        "expired_at": _seconds(batch.expired_at),
        "cancelling_at": _seconds(batch.cancelling_at),
        "cancelled_at": _seconds(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata_,
    }
