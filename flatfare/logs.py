"""Logging for every Flatfare process: one JSON object per line, with the request's id, account and model.

Each process calls :func:`configure_logging` once at start. Fields known for the request being handled
live in a context variable (:func:`bind`, :func:`log_context`), so any line written while handling it
carries them without passing them around; asyncio tasks inherit them.

Secrets never reach a log: API keys, Stripe keys and bearer tokens are masked in every line, whatever
wrote it (:func:`redact`). Prompts and outputs are logged only when ``FLATFARE_LOG_PROMPTS`` is on;
code that would log one asks :func:`prompts_enabled` first.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

LogFormat = Literal["json", "text"]

# The request-scoped fields of every line. Never mutated in place: each bind sets a new mapping.
_CONTEXT: ContextVar[Mapping[str, Any]] = ContextVar("flatfare_log_context", default={})
_LOG_PROMPTS = False
_HANDLER_MARK = "_flatfare_handler"

# Flatfare keys and admin tokens keep their visible prefix (the characters stored beside the hash), so
# a line still says which one it was; Stripe secrets and bearer tokens are masked whole.
_SECRETS = re.compile(
    r"(?P<key>ffa?-[A-Za-z0-9_-]{8})[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"
    r"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{6,}"
    r"|whsec_[A-Za-z0-9+/=]{6,}"
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{6,}"
)
_MASK = "[redacted]"


# Every secret the pattern matches contains one of these: a line without any (most lines) skips the
# regex, which cost 10 us for a request's log line.
_MARKERS = ("ff-", "ffa-", "sk_", "rk_", "whsec_")


def redact(text: str) -> str:
    """``text`` with every API key, Stripe secret and bearer token masked."""
    if not any(marker in text for marker in _MARKERS) and "bearer" not in text.lower():
        return text
    return _SECRETS.sub(lambda m: (m.group("key") or "") + _MASK, text)


def bind(**fields: Any) -> None:
    """Add fields to every line the current task (and the tasks it starts) writes from now on."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Fields for the lines written inside the block."""
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def prompts_enabled() -> bool:
    """Whether prompts and outputs may be logged (``FLATFARE_LOG_PROMPTS``; off unless switched on)."""
    return _LOG_PROMPTS


class JsonLinesFormatter(OrjsonFormatter):
    """``{"time", "level", "logger", "message", ...context, ...extra}`` with secrets masked (orjson
    serialises a line in 5 us; the stdlib json formatter took 25)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rename_fields", {"levelname": "level", "name": "logger"})
        kwargs.setdefault("timestamp", "time")
        # uvicorn's color_message repeats the message with terminal escapes.
        kwargs.setdefault("reserved_attrs", [*RESERVED_ATTRS, "color_message", "taskName"])
        super().__init__(*args or ("%(levelname)s %(name)s %(message)s",), **kwargs)

    def add_fields(self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_record, record, message_dict)
        for key, value in _CONTEXT.get().items():
            log_record.setdefault(key, value)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class TextFormatter(logging.Formatter):
    """Plain lines for a terminal, context fields appended, secrets masked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args or ("%(asctime)s %(levelname)s %(name)s %(message)s",), **kwargs)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(f"{k}={v}" for k, v in _CONTEXT.get().items())
        return redact(f"{line} [{context}]" if context else line)


def _formatter_class(fmt: LogFormat) -> type[logging.Formatter]:
    return JsonLinesFormatter if fmt == "json" else TextFormatter


def configure_logging(level: str = "info", fmt: LogFormat = "json", *, log_prompts: bool = False) -> None:
    """Send every logger's lines to stderr in ``fmt``; safe to call again (it replaces its handler)."""
    global _LOG_PROMPTS
    _LOG_PROMPTS = log_prompts
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter_class(fmt)())
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python warnings become lines of the same format
    # uvicorn's loggers write through the root handler, in the same format. Its access log stays as
    # uvicorn set it (the gateway writes its own line per request).
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class LoggingLevels:
    """What decides whether a line gets written, as it is now: ``logging.disable``'s threshold, the root
    logger's level and handlers, and the level of each handler of the root and ``vllm`` loggers.

    :meth:`restore` puts it back after code that changed it as a side effect. Importing vLLM 0.26's API
    server (``vllm.entrypoints.openai.api_server``) imports ``model_hosting_container_standards``, whose
    import sets the root logger and each of its handlers to ERROR (``configure_root_logger``): no line of
    the worker, nor of the engine process it forks afterwards, was written after that."""

    def __init__(self) -> None:
        root = logging.getLogger()
        self._disable = root.manager.disable
        self._root_level = root.level
        self._root_handlers = list(root.handlers)
        self._handler_levels = [(h, h.level) for lg in (root, logging.getLogger("vllm")) for h in lg.handlers]

    def restore(self) -> list[str]:
        """Put everything back; what had changed, for a log line ([] if nothing had)."""
        root = logging.getLogger()
        changed: list[str] = []
        if root.manager.disable != self._disable:
            changed.append(f"logging.disable({logging.getLevelName(root.manager.disable)})")
            logging.disable(self._disable)
        if root.level != self._root_level:
            changed.append(f"root level {logging.getLevelName(root.level)}")
            root.setLevel(self._root_level)
        if not root.handlers and self._root_handlers:
            changed.append("root handlers removed")
            for handler in self._root_handlers:
                root.addHandler(handler)
        for handler, level in self._handler_levels:
            if handler.level != level:
                changed.append(f"handler {handler.get_name() or type(handler).__name__} at "
                               f"{logging.getLevelName(handler.level)}")
                handler.setLevel(level)
        return changed


def dict_config(level: str = "info", fmt: LogFormat = "json") -> dict[str, Any]:
    """The same setup as a ``logging.config.dictConfig`` mapping, for libraries that take one (vLLM
    applies it in its engine processes too)."""
    formatter = f"{_formatter_class(fmt).__module__}.{_formatter_class(fmt).__name__}"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"flatfare": {"()": formatter}},
        "handlers": {"flatfare": {"class": "logging.StreamHandler", "formatter": "flatfare",
                                  "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["flatfare"], "level": level.upper(), "propagate": False}},
        "root": {"handlers": ["flatfare"], "level": level.upper()},
    }
