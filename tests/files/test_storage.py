"""The file stores behind the Files API, each through the one interface: the local folder, and S3 through
boto3 against moto's S3 server (one part and multipart objects). A put whose stream fails leaves nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import boto3
import pytest

from flatfare.gateway.files.storage import PART_BYTES, FileStore, LocalStore, ObjectMissing, S3Store
from tests.files.conftest import BUCKET, S3Server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FileStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "files")
        return
    s3: S3Server = request.getfixturevalue("s3_server")
    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    yield S3Store(client, BUCKET, prefix=f"{tmp_path.name}/")


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def read(store: FileStore, key: str) -> bytes:
    return b"".join([chunk async for chunk in await store.get(key)])


async def test_put_get_exists_delete(store: FileStore) -> None:
    assert not await store.exists("1/file-a")
    await store.put("1/file-a", chunks(b"hello ", b"world"))
    assert await store.exists("1/file-a")
    assert await read(store, "1/file-a") == b"hello world"
    await store.put("1/file-a", chunks(b"replaced"))
    assert await read(store, "1/file-a") == b"replaced"
    await store.put("1/file-empty", chunks())
    assert await read(store, "1/file-empty") == b""
    await store.delete("1/file-a")
    await store.delete("1/file-a")  # already gone: no error
    assert not await store.exists("1/file-a")
    with pytest.raises(ObjectMissing):
        await store.get("1/file-a")


async def test_a_large_object_goes_in_parts_and_comes_back_whole(store: FileStore) -> None:
    block = bytes(range(256)) * 4096  # 1 MiB
    count = PART_BYTES // len(block) * 2 + 3  # two full parts and a short last one
    await store.put("2/file-big", chunks(*(block for _ in range(count))))
    assert await read(store, "2/file-big") == block * count


async def test_a_put_whose_stream_fails_leaves_nothing(store: FileStore, request: pytest.FixtureRequest) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a" * PART_BYTES  # past one part: S3 has begun a multipart upload
        yield b"b"
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        await store.put("3/file-broken", failing())
    assert not await store.exists("3/file-broken")
    if isinstance(store, LocalStore):
        assert list((store.root / "3").iterdir()) == []
    else:
        s3: S3Server = request.getfixturevalue("s3_server")
        uploads = s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix)
        assert uploads.get("Uploads", []) == []
