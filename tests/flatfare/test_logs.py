"""One JSON object per line, the request's fields from the context, and no secret in any line."""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config

import pytest

from flatfare.logs import bind, configure_logging, dict_config, log_context, prompts_enabled, redact

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


def test_prompts_are_off_unless_switched_on() -> None:
    configure_logging("info", "text")
    assert not prompts_enabled()
    configure_logging("info", "text", log_prompts=True)
    assert prompts_enabled()
    configure_logging("info", "text")


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
