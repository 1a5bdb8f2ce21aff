"""The Files API through the official ``openai`` SDK against a live gateway (two processes), on SQLite and
PostgreSQL with the local store and on the S3 store (moto's S3 server): the round trip, ownership, the
size cap enforced while the upload streams, batch input checked line by line, the per-account caps
(exact under concurrent uploads), listing pages, expiry. Nothing here is inference: no quota unit, no
ledger row."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.contract import quota_counter_key
from tests.conftest import eventually
from tests.files.conftest import ACCOUNT_MAX_FILES, MAX_BYTES, MIB, FilesPlatform

pytestmark = pytest.mark.e2e


def batch_line(name: str, **changes: object) -> dict[str, object]:
    line: dict[str, object] = {"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "instant", "messages": [{"role": "user", "content": "hi"}]}}
    return {**line, **changes}


def jsonl(*lines: object) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def spent(platform: FilesPlatform, account: int) -> tuple[int, int]:
    """(ledger rows, quota units counted today) of the account."""
    rows = platform.stack.sql("SELECT count(*) FROM requests WHERE account_id = :a", a=account)[0][0]
    client = redis_sync.Redis.from_url(platform.stack.redis_url)
    try:
        units = int(client.get(quota_counter_key(account, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()
    return rows, units


def refused(call: object, status: int) -> dict[str, object]:
    """The OpenAI error body of a call the SDK saw refused with ``status``."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.status_code == status, caught.value.response.text
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_upload_list_retrieve_content_delete(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    content = b"hello files\n" * 1000 + bytes(range(256))
    uploaded = client.files.create(file=("notes.txt", content), purpose="user_data")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.expires_at) == (
        len(content), "notes.txt", "user_data", None)
    assert platform.stored_objects(account) == [uploaded.id]

    assert client.files.retrieve(uploaded.id) == uploaded
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert [f.id for f in client.files.list(purpose="user_data")] == [uploaded.id]
    assert list(client.files.list(purpose="batch")) == []
    assert client.files.content(uploaded.id).content == content
    with client.files.with_streaming_response.content(uploaded.id) as streamed:
        assert streamed.headers["content-type"] == "application/octet-stream"
        assert b"".join(streamed.iter_bytes()) == content

    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    error = refused(lambda: client.files.retrieve(uploaded.id), 404)
    assert error["code"] == "file_not_found" and uploaded.id in str(error["message"])
    refused(lambda: client.files.content(uploaded.id), 404)
    refused(lambda: client.files.delete(uploaded.id), 404)
    assert list(client.files.list()) == []
    assert platform.stored_objects(account) == [] and platform.usage(account) == (0, 0)
    assert spent(platform, account) == (0, 0)  # the Files API is no inference: free


def test_another_accounts_file_is_not_found(platform: FilesPlatform) -> None:
    _, owner = platform.new_account()
    _, other = platform.new_account()
    mine = owner.files.create(file=("mine.txt", b"private"), purpose="user_data")
    for call in (lambda: other.files.retrieve(mine.id), lambda: other.files.content(mine.id),
                 lambda: other.files.delete(mine.id)):
        assert refused(call, 404)["code"] == "file_not_found"
    assert list(other.files.list()) == []
    refused(lambda: other.files.list(after=mine.id), 400)
    assert owner.files.content(mine.id).content == b"private"


def test_an_oversized_upload_is_refused_with_413_and_nothing_stored(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    error = refused(lambda: client.files.create(file=("big.bin", b"x" * (MAX_BYTES + 1)), purpose="user_data"), 413)
    assert error["code"] == "request_too_large" and error["param"] == "file"

    # Without a Content-Length (chunked), the cap is enforced while the body streams in.
    def body() -> Iterator[bytes]:
        yield (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
               b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n')
        for _ in range(MAX_BYTES // (64 * 1024) + 2):
            yield b"y" * 64 * 1024
        yield b"\r\n--b--\r\n"

    answer = httpx.post(f"{platform.stack.base_url}/v1/files", content=body(), timeout=60,
                        headers={"Authorization": f"Bearer {client.api_key}",
                                 "Content-Type": "multipart/form-data; boundary=b"})
    assert answer.status_code == 413, answer.text
    assert "content-length" not in answer.request.headers
    assert answer.json()["error"]["code"] == "request_too_large"

    exactly = client.files.create(file=("max.bin", b"z" * MAX_BYTES), purpose="user_data")
    assert exactly.bytes == MAX_BYTES
    assert [row[0] for row in platform.rows(account)] == [exactly.id]
    assert platform.stored_objects(account) == [exactly.id]
    assert platform.usage(account) == (1, MAX_BYTES)
    assert platform.spooled() == []


@pytest.mark.parametrize(("lines", "line", "says"), [
    ((batch_line("a"), batch_line("b"), b"{not json"), 3, "not valid JSON"),
    ((batch_line("a"), b"[1, 2]"), 2, "JSON object"),
    ((batch_line("a"), batch_line("b"), batch_line("c"), batch_line("b")), 4, "custom_id 'b'"),
    ((batch_line("a", custom_id=7),), 1, "custom_id"),
    ((batch_line("a"), batch_line("b", method="GET")), 2, "method"),
    ((batch_line("a", url="/v1/images/generations"),), 1, "/v1/embeddings"),
    ((batch_line("a"), batch_line("b", body="hi")), 2, "body"),
])
def test_a_bad_batch_file_is_refused_naming_its_line(platform: FilesPlatform, lines: tuple[object, ...], line: int,
                                                     says: str) -> None:
    account, client = platform.new_account()
    error = refused(lambda: client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch"), 400)
    assert error["code"] == "invalid_batch_file" and error["param"] == "file"
    assert f"Line {line}:" in str(error["message"]) and says in str(error["message"]), error["message"]
    assert platform.rows(account) == [] and platform.stored_objects(account) == [] and platform.spooled() == []


def test_a_batch_file_is_accepted_and_expires_in_30_days_by_default(platform: FilesPlatform) -> None:
    _, client = platform.new_account()
    urls = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    content = jsonl(*(batch_line(f"req-{n}", url=urls[n % 4]) for n in range(100)))
    stored = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert stored.purpose == "batch" and stored.bytes == len(content)
    assert stored.expires_at == stored.created_at + 30 * 86400
    chosen = client.files.create(file=("in.jsonl", content), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert chosen.expires_at == chosen.created_at + 3600
    error = refused(lambda: client.files.create(file=("in.jsonl", content), purpose="batch",
                                                expires_after={"anchor": "created_at", "seconds": 60}), 400)
    assert error["param"] == "expires_after.seconds"
    assert refused(lambda: client.files.create(file=("empty.jsonl", b"\n"), purpose="batch"),
                   400)["code"] == "invalid_batch_file"


def test_purposes_flatfare_has_no_api_for_are_refused(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    for purpose in ("fine-tune", "assistants", "vision", "evals", "batch_output"):
        error = refused(lambda p=purpose: client.files.create(file=("x.txt", b"x"), purpose=p), 400)
        assert error["param"] == "purpose", error
    answer = httpx.post(f"{platform.stack.base_url}/v1/files", files={"file": ("x.txt", b"x")}, timeout=30,
                        headers={"Authorization": f"Bearer {client.api_key}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "purpose"
    answer = httpx.post(f"{platform.stack.base_url}/v1/files", json={"purpose": "user_data"}, timeout=30,
                        headers={"Authorization": f"Bearer {client.api_key}"})
    assert answer.status_code == 400, answer.text
    unauthenticated = httpx.get(f"{platform.stack.base_url}/v1/files", timeout=30)
    assert unauthenticated.status_code == 401
    assert platform.rows(account) == []


def test_the_file_count_cap_is_exact_under_concurrent_uploads(platform: FilesPlatform) -> None:
    account, client = platform.new_account()

    def upload(n: int) -> str | int:
        try:
            return client.files.create(file=(f"{n}.txt", b"n" * 100), purpose="user_data").id
        except openai.APIStatusError as exc:
            assert exc.response.json()["error"]["code"] == "too_many_files", exc.response.text
            return exc.status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(upload, range(ACCOUNT_MAX_FILES + 4)))
    stored = sorted(o for o in outcomes if isinstance(o, str))
    assert len(stored) == ACCOUNT_MAX_FILES and outcomes.count(400) == 4
    assert sorted(row[0] for row in platform.rows(account)) == stored == platform.stored_objects(account)
    assert platform.usage(account) == (ACCOUNT_MAX_FILES, 100 * ACCOUNT_MAX_FILES)
    client.files.delete(stored[0])
    client.files.create(file=("again.txt", b"a"), purpose="user_data")  # the freed slot takes one more


def test_the_storage_cap_refuses_a_file_that_does_not_fit(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    kept = [client.files.create(file=(f"{n}.bin", b"m" * MIB), purpose="user_data").id for n in range(2)]
    error = refused(lambda: client.files.create(file=("third.bin", b"m" * MIB), purpose="user_data"), 400)
    assert error["code"] == "storage_limit_exceeded"
    assert sorted(row[0] for row in platform.rows(account)) == sorted(kept) == platform.stored_objects(account)
    assert platform.usage(account) == (2, 2 * MIB)
    client.files.create(file=("small.bin", b"s" * (MIB // 4)), purpose="user_data")  # what still fits does


def test_the_list_pages_in_order(platform: FilesPlatform) -> None:
    _, client = platform.new_account()
    ids = [client.files.create(file=(f"{n}.txt", b"p"), purpose="user_data").id for n in range(ACCOUNT_MAX_FILES)]
    newest_first = client.files.list(limit=3)
    assert [f.id for f in newest_first.data] == ids[::-1][:3] and newest_first.has_more
    assert [f.id for f in client.files.list(limit=3)] == ids[::-1]  # the SDK pages on with `after`
    assert [f.id for f in client.files.list(order="asc", after=ids[0])] == ids[1:]
    assert refused(lambda: client.files.list(limit=0), 400)["param"] == "limit"


def test_an_expired_file_is_gone_and_swept(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    stored = client.files.create(file=("soon.txt", b"e" * 10), purpose="user_data",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert stored.expires_at == stored.created_at + 3600
    platform.stack.sql("UPDATE files SET expires_at = :t WHERE id = :id", t="2020-01-01 00:00:00",
                       id=stored.id)
    refused(lambda: client.files.retrieve(stored.id), 404)
    eventually(lambda: (platform.stored_objects(account), platform.rows(account), platform.usage(account)),
               lambda seen: seen == ([], [], (0, 0)), "the expired file swept")


def answered(platform: FilesPlatform, status: int) -> float:
    """Uploads the gateway (all its processes) answered with ``status``, from its /metrics."""
    text = httpx.get(f"{platform.stack.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flatfare_requests_total{") and 'route="/v1/files"' in line
               and f'status="{status}"' in line)


def test_an_upload_cut_off_midway_stores_nothing_and_is_no_server_error(platform: FilesPlatform) -> None:
    account, client = platform.new_account()
    before = answered(platform, 400), answered(platform, 500)
    form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="cut.bin"\r\n\r\n' + b"c" * 100_000)
    address = urlsplit(platform.stack.base_url)
    with socket.create_connection((address.hostname, address.port)) as conn:  # closed with the body half sent
        conn.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                     b"Authorization: Bearer " + client.api_key.encode() + b"\r\n"
                     b"Content-Length: " + str(len(form) + 500_000).encode() + b"\r\n\r\n" + form)
    eventually(lambda: answered(platform, 400), lambda seen: seen == before[0] + 1, "the cut-off upload answered")
    assert answered(platform, 500) == before[1]
    assert platform.rows(account) == [] and platform.stored_objects(account) == [] and platform.spooled() == []


def test_an_upload_announced_too_large_is_refused_before_its_body(platform: FilesPlatform) -> None:
    _, client = platform.new_account()
    address = urlsplit(platform.stack.base_url)
    with socket.create_connection((address.hostname, address.port), timeout=60) as conn:
        conn.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                     b"Authorization: Bearer " + client.api_key.encode() + b"\r\nContent-Length: 10000000000\r\n\r\n")
        head = conn.recv(65536)  # 10 GB announced, none sent: only a refusal that reads nothing answers
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
