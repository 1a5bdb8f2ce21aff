"""One JSON object per line, the request's fields from the context, and no secret in any line."""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config
import time
import uuid

import pytest

from flatfare import contract
from flatfare.contract import Endpoint, Job, Reply, WorkerInfo
from flatfare.logs import bind, configure_logging, dict_config, log_context, redact
from flatfare.workers.instant import FILLER, InstantEngine
from flatfare.workers.loop import WorkerLoop

KEY = "ff-" + "A1b2C3d4" + "x" * 35


@pytest.fixture
def lines(capsys: pytest.CaptureFixture[str]):
    """Configures JSON logging on first use (inside the test, where capsys holds stderr) and reads it."""
    started = False

    def read() -> list[dict]:
        nonlocal started
        if not started:
            started = True
            configure_logging("info", "json")
            return []
        return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]

    yield read
    configure_logging("info", "text")


def test_lines_are_json_with_the_request_context(lines) -> None:
    lines()
    log = logging.getLogger("flatfare.test")
    with log_context(request_id="r1", account="acme", model="m"):
        log.info("answered %s", 200, extra={"status": 200})
    log.warning("outside")
    first, second = lines()
    assert first["message"] == "answered 200" and first["level"] == "INFO" and first["logger"] == "flatfare.test"
    assert (first["request_id"], first["account"], first["model"], first["status"]) == ("r1", "acme", "m", 200)
    assert "time" in first and "request_id" not in second


async def test_bind_is_scoped_to_the_task(lines) -> None:
    lines()
    log = logging.getLogger("flatfare.test")

    async def job(request_id: str) -> None:
        bind(request_id=request_id)
        await asyncio.sleep(0)
        log.info("job")

    await asyncio.gather(job("a"), job("b"))
    log.info("after")
    records = lines()
    assert sorted(r.get("request_id") for r in records if r["message"] == "job") == ["a", "b"]
    assert "request_id" not in records[-1]


def test_secrets_are_masked_whoever_logs_them(lines) -> None:
    lines()
    log = logging.getLogger("some.library")
    log.info("Authorization: Bearer %s", KEY)
    log.info("key %s, stripe sk_live_51Habcdefgh and whsec_abcdefgh", KEY)
    try:
        raise ValueError(f"bad key {KEY}")
    except ValueError:
        log.exception("failed")
    text = json.dumps(lines())
    assert KEY not in text and "x" * 35 not in text
    assert "sk_live_51H" not in text and "whsec_abcdefgh" not in text
    assert "ff-A1b2C3d4[redacted]" in text  # the key's visible prefix stays, to tell keys apart


def test_redact_leaves_ordinary_text_alone() -> None:
    assert redact("chatcmpl-abc model ff-short bearer") == "chatcmpl-abc model ff-short bearer"


async def _serve_one(redis, content: str) -> str:  # noqa: ANN001 - a redis.asyncio client
    """One chat job through a real worker loop (the instant engine) on the private Redis; its request id."""
    engine = InstantEngine(tokens=2)
    info = WorkerInfo(worker_id=f"w-{uuid.uuid4().hex[:6]}", model="m", max_model_len=engine.max_model_len,
                      capacity=4, engine="instant")
    worker = WorkerLoop(redis, engine, info, lease_s=5)
    running = asyncio.create_task(worker.run())
    request_id = uuid.uuid4().hex
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    await redis.xadd(contract.job_stream("m"), Job(request_id, Endpoint.CHAT, body, int(time.time() * 1000)).to_fields())
    deadline = time.monotonic() + 20
    while not any(Reply.from_fields(f).kind.terminal for _, f in await redis.xrange(contract.reply_stream(request_id))):
        assert time.monotonic() < deadline, "the worker never answered"
        await asyncio.sleep(0.02)
    worker.stop()
    await asyncio.wait_for(running, 20)
    return request_id


async def test_a_worker_logs_prompts_only_when_switched_on(lines, redis) -> None:
    """FLATFARE_LOG_PROMPTS: off by default, a worker's log has no prompt or output; switched on, it
    has the job's prompt and its (non-streaming) output, on lines that carry the job's request id."""
    lines()  # JSON lines, prompts off: the default
    quiet = f"a private question {uuid.uuid4().hex}"
    quiet_id = await _serve_one(redis, quiet)
    configure_logging("info", "json", log_prompts=True)
    loud = f"a question to debug {uuid.uuid4().hex}"
    loud_id = await _serve_one(redis, loud)
    configure_logging("info", "json")
    records = lines()
    assert quiet not in json.dumps(records)
    assert not [r for r in records if r.get("request_id") == quiet_id and ("prompt" in r or "output" in r)]
    mine = [r for r in records if r.get("request_id") == loud_id]
    assert [r["prompt"] for r in mine if "prompt" in r] == [[{"role": "user", "content": loud}]]
    assert any(InstantEngine(tokens=2).tokens * FILLER in r.get("output", "") for r in mine)


def test_dict_config_is_the_same_format(capsys: pytest.CaptureFixture[str]) -> None:
    logging.config.dictConfig(dict_config("info", "json"))
    try:
        logging.getLogger("vllm.engine").info("loaded %s", KEY)
        (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x]
        assert line["logger"] == "vllm.engine" and KEY not in line["message"]
    finally:
        configure_logging("info", "text")
        logging.getLogger("vllm").handlers.clear()
        logging.getLogger("vllm").propagate = True
