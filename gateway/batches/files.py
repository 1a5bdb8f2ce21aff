"""A batch's files, through the Files API's service: its input read back, its output and error files
stored as files of purpose ``batch_output`` owned by the batch's account (the same caps, the same store)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from flatfare.gateway.errors import APIError
from flatfare.gateway.files.service import FileService

INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


class BatchFiles:
    def __init__(self, files: FileService) -> None:
        self._files = files

    async def input_exists(self, account_id: int, file_id: str) -> bool:
        """Whether the account has a live file of purpose ``batch`` under this id."""
        try:
            found = await self._files.get(account_id, file_id)
        except APIError as exc:
            if exc.status == 404:
                return False
            raise
        return found.purpose == INPUT_PURPOSE

    async def input_lines(self, account_id: int, file_id: str) -> list[bytes] | None:
        """The input file's lines, or None when the account has no such batch file (any more)."""
        if not await self.input_exists(account_id, file_id):
            return None
        try:
            _, chunks = await self._files.content(account_id, file_id)
        except APIError as exc:
            if exc.status == 404:
                return None
            raise
        return b"".join([chunk async for chunk in chunks]).splitlines()

    async def write_output(self, account_id: int, filename: str, lines: list[str]) -> str:
        """Store ``lines`` as a new JSONL file of purpose ``batch_output``; returns its id."""
        data = "".join(f"{line}\n" for line in lines).encode()

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        return (await self._files.create(account_id, filename, OUTPUT_PURPOSE, chunks())).id
