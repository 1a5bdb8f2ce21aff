"""The only module that imports vLLM.

It builds an in-process ``AsyncLLM`` from the same arguments ``vllm serve`` takes, then vLLM's own
OpenAI serving objects on top of it (no HTTP server), so chat templates, tool calls, JSON mode and
structured outputs behave exactly as in ``vllm serve``. Module paths moved between vLLM 0.26 (the
GPU build) and 0.32 (the CPU build); both are handled here and nowhere else.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import importlib
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flatfare.capabilities import chat_template_path
from flatfare.contract import Endpoint, error_body
from flatfare.logs import LoggingLevels


# vLLM fetches a request's media URLs itself (aiohttp, which honours HTTPS_PROXY). The gateway checked
# each URL's host; a redirect would take the fetch somewhere it did not check (169.254.169.254, say),
# so none is followed. One image may cost at most 20 MB downloaded and 7680 x 4320 pixels decoded (the
# gateway's bound for inline images, gateway/openai/media.py). An operator's own value of any of these wins.
MEDIA_LIMITS = {
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "20",
    "VLLM_MAX_IMAGE_PIXELS": "33177600",
}


log = logging.getLogger("flatfare.worker")

# Options newer than the oldest vLLM Flatfare supports (0.26, the GPU build), each with what an engine
# without it does instead. Such an option in the catalog is left out there, with a warning, rather
# than keeping the worker from starting: the catalog is shared by workers of both builds.
NEWER_FLAGS = {
    "--tool-strict-level": "tool calls are held to the tools' schemas only for tools marked strict",
}


class EngineError(Exception):
    """The engine could not be built or failed; the message says what to change."""


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What one request produced: a stream of SSE payloads, a whole response, or an error."""

    stream: AsyncIterator[str] | None = None
    body: str | None = None
    error_status: int = 0
    error: dict[str, Any] | None = None


def _first_attr(candidates: list[tuple[str, str]]) -> Any:
    for module_name, attr in candidates:
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
    names = ", ".join(f"{m}.{a}" for m, a in candidates)
    raise EngineError(f"this vLLM version has none of {names}; Flatfare supports vLLM 0.26 to 0.32")


def engine_argv(model_path: str, served_name: str, options: dict[str, Any]) -> list[str]:
    """Turn catalog engine options into ``vllm serve`` arguments (``max_model_len`` -> ``--max-model-len``).
    A named ``chat_template`` becomes the path of the template Flatfare ships under that name."""
    argv = ["--model", model_path, "--served-model-name", served_name]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if key == "chat_template":
            try:
                value = chat_template_path(str(value))
            except ValueError as exc:
                raise EngineError(str(exc)) from exc
        if value is False:  # vLLM's boolean engine flags all take a --no- form
            argv.append("--no-" + flag[2:])
        elif value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv.extend([flag, *map(str, value)])
        elif isinstance(value, dict):
            argv.extend([flag, json.dumps(value)])
        else:
            argv.extend([flag, str(value)])
    return argv


def without_unknown_newer_flags(argv: list[str], parser: Any) -> list[str]:
    """``argv`` less the :data:`NEWER_FLAGS` (and their values) this vLLM's ``parser`` lacks."""
    known = {option for action in parser._actions for option in action.option_strings}
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip and not arg.startswith("--"):
            continue
        skip = arg in NEWER_FLAGS and arg not in known
        if skip:
            log.warning("this vLLM has no %s, which the catalog sets: %s", arg, NEWER_FLAGS[arg])
        else:
            kept.append(arg)
    return kept


def gpus_needed(options: dict[str, Any]) -> int:
    """GPUs one engine spans: tensor parallel × pipeline parallel."""
    return int(options.get("tensor_parallel_size") or 1) * int(options.get("pipeline_parallel_size") or 1)


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(options: dict[str, Any], visible: int | None = None) -> None:
    """Refuse, before loading anything, an engine that needs more GPUs than this worker can see."""
    needed = gpus_needed(options)
    if needed <= 1:
        return
    visible = visible_gpus() if visible is None else visible
    if visible < needed:
        raise EngineError(f"tensor_parallel_size x pipeline_parallel_size = {needed} needs {needed} GPUs, but "
                          f"{visible} are visible to this worker; give it more (CUDA_VISIBLE_DEVICES, the "
                          "container's GPU reservation) or lower tensor_parallel_size")


@dataclass(frozen=True, slots=True)
class Serving:
    """How vLLM serves one job kind: its request model (module, class candidates across vLLM versions)
    and the serving object ``init_app_state`` builds for it (the ``state`` attribute; vLLM builds it
    only when the model's supported tasks include the kind's). ``method`` is the call that runs a
    request; None: the object itself is called (vLLM's pooling servings)."""

    request: tuple[tuple[str, str], ...]
    state_attr: str
    method: str | None


# The worker's side of each job kind (contract.Endpoint); the gateway's is flatfare.gateway.openai.kinds.
SERVING = {
    Endpoint.CHAT: Serving((("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),),
                           "openai_serving_chat", "create_chat_completion"),
    Endpoint.COMPLETION: Serving((("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),),
                                 "openai_serving_completion", "create_completion"),
    # Flatfare's embeddings carry texts or token ids (never chat messages): vLLM's completion-style request.
    Endpoint.EMBEDDINGS: Serving((("vllm.entrypoints.pooling.embed.protocol", "EmbeddingCompletionRequest"),),
                                 "serving_embedding", None),
    Endpoint.RESPONSES: Serving((("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),),
                                "openai_serving_responses", "create_responses"),
}

SLEEP_FLAG = "--enable-sleep-mode"
# A LoRA variant's adapter, by its catalog name: where it is (a folder or hub id), or None if the
# catalog has no such variant of this engine's model.
VariantSource = Callable[[str], Awaitable[str | None]]


@dataclass
class EnginePace:
    """What the engine says of its own pace, for the worker's pace governor (flatfare.workers.pace): every
    request's inter-token latencies at each step, as vLLM's output processor times them (the engine core's
    output timestamps: no front-end lag, no chunks coalesced), and the fewest requests its scheduler had
    waiting since the last look (above zero: the engine is behind its own queue). Fed by a stat logger vLLM
    calls with each batch of outputs (:meth:`logger`); read and reset by the worker once a window."""

    gaps: list[float] = field(default_factory=list)
    fewest_waiting: int | None = None
    running: int = 0

    MAX_GAPS = 200_000  # if nobody reads them (no governor), the oldest go

    def take(self) -> tuple[list[float], int]:
        gaps, self.gaps = self.gaps, []
        waiting, self.fewest_waiting = self.fewest_waiting or 0, None
        return gaps, waiting

    def logger(self) -> type:
        """A per-engine stat logger class for ``AsyncLLM(stat_loggers=...)`` (vLLM 0.26 and 0.32 alike)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        pace = self

        class PaceLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0, **_: Any) -> None:
                if iteration_stats is not None:
                    pace.gaps.extend(getattr(iteration_stats, "inter_token_latencies_iter", ()))
                    if len(pace.gaps) > pace.MAX_GAPS:
                        del pace.gaps[:len(pace.gaps) // 2]
                if scheduler_stats is not None:
                    waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
                    pace.fewest_waiting = waiting if pace.fewest_waiting is None else min(pace.fewest_waiting,
                                                                                          waiting)
                    pace.running = int(getattr(scheduler_stats, "num_running_reqs", 0))

            def log_engine_initialized(self) -> None:
                pass

        return PaceLogger


class Engine:
    """An ``AsyncLLM`` plus vLLM's OpenAI serving layer for one model.

    ``sleep_mode`` starts it with vLLM's sleep mode where the platform has one. ``variants`` finds the
    adapter of a LoRA variant a request names that the engine has not loaded yet."""

    def __init__(self, argv: list[str], *, engine_metrics: bool = True,
                 logging_config: dict[str, Any] | None = None, sleep_mode: bool = False,
                 variants: VariantSource | None = None, pace: bool | None = None) -> None:
        self._argv = argv
        # Report the engine's pace (EnginePace) for the worker's governor: True, False, or None: but on the CPU.
        self._pace = pace
        self._sleep_mode = sleep_mode or SLEEP_FLAG in argv
        self._variant_source = variants
        # Why it cannot sleep ("" once started with sleep mode).
        self.sleep_unavailable = "the engine has not started"
        # LoRA variants loaded, by name -> adapter path; True once started with enable_lora.
        self.variants: dict[str, str] = {}
        self.lora_enabled = False
        # vLLM's platform once started ("cuda", "cpu", ...).
        self.device_type = ""
        self._variant_lock = asyncio.Lock()
        self._models: Any = None
        self._load_request: Any = None
        self._served: str = ""
        self._engine_metrics = engine_metrics
        self._logging_config = logging_config
        self._llm: Any = None
        self._chat: Any = None
        # Each job kind this model serves -> (vLLM's request model, the call that runs it).
        self._serving: dict[Endpoint, tuple[Any, Callable[..., Awaitable[Any]]]] = {}
        self._client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError, NotImplementedError)
        self.max_model_len = 0
        self.max_num_seqs = 0
        # What the engine started with, once started (:func:`effective_config`).
        self.engine_config: dict[str, Any] = {}
        # Its own pace, step by step (the pace governor's input).
        self.pace = EnginePace()
        # Whether vLLM exports OTLP traces (its otlp_traces_endpoint option): only then is a job's trace
        # context handed to it (vLLM drops it otherwise, with a warning).
        self.tracing = False

    async def start(self) -> None:
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        for name, value in MEDIA_LIMITS.items():
            os.environ.setdefault(name, value)
        if self._logging_config is not None:
            _use_logging_config(self._logging_config)
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs

        # vLLM applied the logging configuration on that first import; the imports below may change it
        # (vLLM 0.26's API server module sets the root logger and its handlers to ERROR: LoggingLevels).
        # Put back before the engine's processes fork from this one, and again once the engine started.
        logging_levels = LoggingLevels()
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        make_arg_parser = _first_attr([
            ("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
            ("vllm.entrypoints.openai.cli_args", "make_arg_parser"),
        ])
        init_app_state = _first_attr([
            ("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
            ("vllm.entrypoints.openai.api_server", "init_app_state"),
        ])
        from vllm import exceptions

        # 0.32 splits request errors into VLLMClientError; 0.26's are ValueErrors.
        client_error = getattr(exceptions, "VLLMClientError", ValueError)
        self._client_errors = (client_error, ValueError, TypeError, NotImplementedError)
        self._load_request = _first_attr([("vllm.entrypoints.serve.lora.protocol", "LoadLoRAAdapterRequest"),
                                          ("vllm.entrypoints.openai.protocol", "LoadLoRAAdapterRequest")])
        from vllm.platforms import current_platform

        _restore_logging(logging_levels)
        argv = [arg for arg in self._argv if arg != SLEEP_FLAG]
        if self._sleep_mode and current_platform.is_sleep_mode_available():
            argv.append(SLEEP_FLAG)
        elif self._sleep_mode:  # vLLM would refuse to start: start without it, and refuse to sleep
            log.warning("sleep mode asked for, but vLLM's %s build has none: the engine starts without it",
                        current_platform.device_type)
        parser = make_arg_parser(FlexibleArgumentParser(prog="flatfare worker"))
        try:
            args = parser.parse_args(without_unknown_newer_flags(argv, parser))
        except SystemExit as exc:
            raise EngineError(f"vLLM refused the engine options {self._argv!r}") from exc
        # vLLM's Prometheus logger: engine metrics (running/waiting requests, KV-cache use, tokens) in the
        # process's default registry without the periodic stats lines, which Flatfare turns off
        # (disable_log_stats). Passing it as a custom logger keeps vLLM from adding its logging one. The pace
        # logger feeds the worker's pace governor (with it, vLLM exports its metrics whatever engine_metrics).
        stat_loggers = []
        if self._pace is True or (self._pace is None and current_platform.device_type != "cpu"):
            stat_loggers.append(self.pace.logger())
        if self._engine_metrics:
            stat_loggers.append(_first_attr([("vllm.v1.metrics.loggers", "PrometheusStatLogger")]))
        # The API server's usage context: vLLM sizes the scheduler by it (on an H200,
        # max_num_batched_tokens 8192 and max_num_seqs 1024 instead of 2048 and 128), so the worker
        # batches exactly like `vllm serve` with the same options.
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args),
                                              usage_context=UsageContext.OPENAI_API_SERVER,
                                              stat_loggers=stat_loggers or None)
        state = State()
        await init_app_state(self._llm, state, args, await self._llm.get_supported_tasks())
        _restore_logging(logging_levels)
        for endpoint, serving in SERVING.items():
            served = getattr(state, serving.state_attr, None)
            if served is not None:
                call = getattr(served, serving.method) if serving.method else served
                self._serving[endpoint] = (_first_attr(list(serving.request)), call)
        self._chat = getattr(state, "openai_serving_chat", None)
        self._models = state.openai_serving_models
        config = self._llm.vllm_config
        self._served = _plain(config.model_config.served_model_name)
        self.lora_enabled = config.lora_config is not None
        self.tracing = bool(getattr(getattr(config, "observability_config", None), "otlp_traces_endpoint", None))
        self.device_type = str(current_platform.device_type)
        if config.model_config.enable_sleep_mode:
            self.sleep_unavailable = ""
        elif not current_platform.is_sleep_mode_available():
            self.sleep_unavailable = (f"vLLM's {current_platform.device_type} build has no sleep mode "
                                      "(is_sleep_mode_available() is False)")
        else:
            self.sleep_unavailable = "the engine was started without sleep mode (FLATFARE_SLEEP_MODE=1)"
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.engine_config = effective_config(config, args, self._chat)
        # vLLM reads its settings from the environment on every access (vllm.envs.__getattr__); its
        # engine core caches them once started, its API server does not. In this process that was 13 %
        # of the GIL at 256 clients on the GPU (1B shape, bench/results/engine_gpu-1b-s4.md): cache
        # them now, as vLLM's engine core does. Nothing changes them after the engine starts.
        from vllm import envs

        getattr(envs, "enable_envs_cache", lambda: None)()

    async def sleep(self, level: int) -> None:
        """Free the accelerator's memory: level 1 keeps the weights in host RAM, level 2 drops them."""
        await self._llm.sleep(level)

    async def wake_up(self, level: int) -> None:
        await self._llm.wake_up()
        if level >= 2:  # the weights were dropped: read them again (vLLM's documented way after level 2)
            await self._llm.collective_rpc("reload_weights")

    async def load_variant(self, name: str, adapter: str) -> None:
        """Serve the LoRA adapter at ``adapter`` (a folder or hub id) under the model name ``name``."""
        if not self.lora_enabled:
            raise EngineError(f"cannot serve the LoRA variant {name!r}: the engine of {self._served} was "
                              "started without enable_lora (set it in the base model's engine options)")
        result = await self._models.load_lora_adapter(self._load_request(lora_name=name, lora_path=adapter))
        if type(result).__name__ == "ErrorResponse":
            raise EngineError(f"vLLM could not load the adapter of {name!r} from {adapter}: {result.error.message}")
        self.variants[name] = adapter
        log.info("serving the LoRA variant %s (adapter %s)", name, adapter)

    async def _ensure_variant(self, name: str) -> EngineResult | None:
        """Load the variant a request names if the catalog has it and it is not loaded yet; an error
        result when it cannot be loaded. A name the catalog does not know is left to vLLM (a 404)."""
        async with self._variant_lock:  # requests for a new variant arriving together load it once
            if name in self.variants:
                return None
            adapter = await self._variant_source(name) if self._variant_source is not None else None
            if adapter is None:
                return None
            try:
                await self.load_variant(name, adapter)
            except EngineError as exc:
                log.error("%s", exc)
                return EngineResult(error_status=503, error=error_body(
                    f"The model {name} cannot be served right now: {exc}", "server_error", "model",
                    "model_unavailable"))
        return None

    async def run(self, endpoint: Endpoint, body: dict[str, Any], traceparent: str = "") -> EngineResult:
        """Run one OpenAI request. Cancel the task iterating ``stream`` to abort it in the engine.
        ``traceparent``: the worker's span, which vLLM's own spans continue while it exports traces."""
        name = body.get("model")
        if isinstance(name, str) and name != self._served and name not in self.variants:
            failed = await self._ensure_variant(name)
            if failed is not None:
                return failed
        serving = self._serving.get(endpoint)
        if serving is None:  # the gateway's capability check keeps these away; a model outside the catalog
            return EngineResult(error_status=400, error=_error(
                400, f"The model {self._served} does not serve {endpoint.path}: its engine has no such task.",
                "model"))
        request_cls, handler = serving
        if endpoint is Endpoint.RESPONSES:
            _as_response_request(body)
        from pydantic import ValidationError

        try:
            request = request_cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            return EngineResult(error_status=400, error=_error(400, first.get("msg", "invalid request"), param))
        except ValueError as exc:
            return EngineResult(error_status=400, error=_error(400, str(exc), None))
        try:
            result = await handler(request, serving_request(traceparent, self.tracing))
        except self._client_errors as exc:
            return EngineResult(error_status=400, error=_error(400, str(exc), getattr(exc, "parameter", None)))
        if hasattr(result, "__aiter__"):
            return EngineResult(stream=_response_events(result) if endpoint is Endpoint.RESPONSES else result)
        if isinstance(getattr(result, "body", None), bytes):  # a pooling serving's JSONResponse
            return EngineResult(body=result.body.decode())
        if hasattr(result, "error") and type(result).__name__ == "ErrorResponse":
            info = result.error
            status = int(info.code) if isinstance(info.code, int) else 400
            return EngineResult(error_status=status, error=_error(status, info.message, info.param))
        # A response's text format names its schema by alias ("schema"), as vLLM's own route sends it.
        return EngineResult(body=result.model_dump_json(by_alias=endpoint is Endpoint.RESPONSES))

    def pace_sample(self) -> tuple[list[float], int]:
        """The inter-token latencies since the last call, and the fewest requests the engine's scheduler had
        waiting meanwhile (:class:`EnginePace`)."""
        return self.pace.take()

    def unfinished_requests(self) -> int:
        """Requests the engine holds (running or waiting): what a freed slot is measured by."""
        if self._llm is None:
            return 0
        # 0.32 has it on AsyncLLM; 0.26 only on its output processor.
        counter = getattr(self._llm, "get_num_unfinished_requests", None) or \
            self._llm.output_processor.get_num_unfinished_requests
        return int(counter())

    @property
    def errored(self) -> bool:
        return bool(self._llm is not None and self._llm.errored)

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


class ServingRequest:
    """What vLLM's serving calls read of the HTTP request ``vllm serve`` hands them (a Starlette
    ``Request``): its headers, from which they take the W3C trace context they pass the engine as
    ``trace_headers`` (and, when present, a request id, data-parallel rank, session and priority: Flatfare
    sends none of these), and ``state``, where they leave the request's metadata."""

    __slots__ = ("headers", "state")

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.state = SimpleNamespace()


def serving_request(traceparent: str, tracing: bool) -> ServingRequest | None:
    """The request object for vLLM's serving call: one carrying ``traceparent`` while the engine exports
    traces; None otherwise (vLLM's own default, as without a request)."""
    return ServingRequest({"traceparent": traceparent}) if tracing and traceparent else None


def _as_response_request(body: dict[str, Any]) -> None:
    """A Responses request as vLLM takes it: the response is named after the job, as OpenAI names
    responses (``resp_...``), and it reports its usage in its last event whatever the stream options."""
    body["request_id"] = f"resp_{body['request_id']}"
    body.pop("stream_options", None)


async def _response_events(events: Any) -> AsyncIterator[str]:
    """vLLM's Responses events (objects) as the SSE payloads the worker relays, as its chat stream sends them."""
    try:
        async for event in events:
            yield f"data: {event.model_dump_json(by_alias=True)}\n\n"
    finally:
        await events.aclose()


def _plain(value: Any) -> Any:
    """A JSON value for ``value``: an enum by its text value (else its name), a dtype and anything
    else vLLM-specific as text."""
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, str) else value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):  # served_model_name may be a list of one
        return _plain(value[0]) if len(value) == 1 else [_plain(v) for v in value]
    return str(value).removeprefix("torch.")


def _speculative(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    draft = getattr(config, "model", None)
    method = getattr(config, "method", None)
    return {"method": _plain(method), "num_speculative_tokens": getattr(config, "num_speculative_tokens", None),
            # A draft model's name or folder; n-gram and the like have none worth showing.
            "draft_model": draft if draft and method not in ("ngram", "suffix") else None}


def effective_config(config: Any, args: Any, chat: Any = None) -> dict[str, Any]:
    """What the engine actually runs with, read back from vLLM once it started (defaults resolved:
    ``max_model_len`` from the model, ``max_num_batched_tokens`` from the usage context, ...), and the
    chat options its OpenAI serving layer got. Small and free of secrets: it is logged and heartbeated.
    An attribute this vLLM lacks reads as None."""
    model, cache = config.model_config, config.cache_config
    scheduler, parallel = config.scheduler_config, config.parallel_config
    compilation = getattr(config, "compilation_config", None)
    template = getattr(args, "chat_template", None)
    values: dict[str, Any] = {
        "vllm_version": _vllm_version(),
        "model": getattr(model, "model", None),
        "served_model_name": getattr(model, "served_model_name", None),
        "max_model_len": getattr(model, "max_model_len", None),
        "dtype": getattr(model, "dtype", None),
        "quantization": getattr(model, "quantization", None),
        "enforce_eager": getattr(model, "enforce_eager", None),
        "trust_remote_code": getattr(model, "trust_remote_code", None),
        "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
        "scheduling_policy": getattr(scheduler, "policy", None),
        "enable_chunked_prefill": getattr(scheduler, "enable_chunked_prefill", None),
        "tensor_parallel_size": getattr(parallel, "tensor_parallel_size", None),
        "pipeline_parallel_size": getattr(parallel, "pipeline_parallel_size", None),
        "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
        "kv_cache_dtype": getattr(cache, "cache_dtype", None),
        "block_size": getattr(cache, "block_size", None),
        "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
        "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
        "compilation_mode": getattr(compilation, "mode", None) if compilation is not None else None,
        "speculative": _speculative(getattr(config, "speculative_config", None)),
        # As the serving layer got them (`vllm serve`'s flags), not as the catalog wrote them.
        "enable_auto_tool_choice": getattr(chat, "enable_auto_tools", getattr(args, "enable_auto_tool_choice", None)),
        "tool_call_parser": getattr(args, "tool_call_parser", None),
        "tool_strict_level": getattr(args, "tool_strict_level", None),
        "reasoning_parser": getattr(args, "reasoning_parser", None)
        or getattr(getattr(config, "structured_outputs_config", None), "reasoning_parser", None) or None,
        # The template's file name: a shipped one's name says which; a worker's own path stays on the worker.
        "chat_template": Path(template).name if template else None,
        "runner": getattr(model, "runner_type", None),
    }
    if values["runner"] == "pooling":  # an embedding model: what `dimensions` may ask of it (the gateway checks)
        values["embedding_size"] = getattr(model, "embedding_size", None)
        matryoshka = getattr(model, "is_matryoshka", False)
        values["matryoshka_dimensions"] = (list(getattr(model, "matryoshka_dimensions", None) or ()) or True
                                           if matryoshka else False)
    return {key: value if isinstance(value, dict) else _plain(value) for key, value in values.items()}


def _vllm_version() -> str | None:
    try:
        return importlib.import_module("vllm").__version__
    except (ImportError, AttributeError):
        return None


def _restore_logging(levels: LoggingLevels) -> None:
    changed = levels.restore()
    if changed:
        log.warning("put back the logging levels that importing vLLM changed: %s", "; ".join(changed))


def _use_logging_config(config: dict[str, Any]) -> None:
    """Have vLLM (and its engine processes, which read the same variables) log through ``config``.
    vLLM applies it when first imported, so this runs before any vLLM import."""
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ:
        return  # the operator's own file wins
    handle, path = tempfile.mkstemp(prefix="flatfare-vllm-logging-", suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(config, file)
    atexit.register(Path(path).unlink, missing_ok=True)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def _error(status: int, message: str, param: str | None) -> dict[str, Any]:
    return error_body(message, "invalid_request_error" if status < 500 else "server_error", param)
