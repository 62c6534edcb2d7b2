"""The engine's HTTP edge under almost-valid input: property-based bodies (a valid request with one or two fields
replaced by a value of the wrong type or range, or no JSON object at all) must get a 4xx with a message, or an
answer; never a 500, a dropped connection, a stream that ends in a server error, or KV left behind. Each bug the
search found has a named test below, so the fix stays visible however hypothesis's search changes."""

from __future__ import annotations

import json
import math
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvmesh.engine.engine import Engine
from kvmesh.engine.openai_types import (
    MAX_CHOICES,
    MAX_CHOICES_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_N,
    MAX_SEQUENCES_PER_REQUEST,
    ChatRequest,
    CompletionRequest,
    TokenizeRequest,
)
from kvmesh.engine.tools import ToolStream, parse_hermes

from .conftest import make_engine
from .engines import serve_engine, wait_idle

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DEEP = "[" * 5000  # JSON text nested past Python's recursion limit
LONE_SURROGATE = "\ud800"  # JSON's "\ud800" escape: a str no UTF-8 encodes
NEVER = "[^\\s\\S]"  # a regex no string matches
DEAD_PEER = "http://127.0.0.1:1"  # refuses at once: a KV pull from it fails and the request computes its prompt
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[tuple[str, Engine]]:
    """A short context (256: a tools prompt takes 150) bounds what a valid fuzzed request may generate: max_tokens
    absent means the rest of it."""
    engine = make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=256)
    with serve_engine(engine) as url:
        yield url, engine
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def http(served: tuple[str, Engine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0], timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """`body` as JSON text as a careless client writes it: NaN and Infinity allowed, lone surrogates escaped."""
    return http.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})


def events(reply: httpx.Response) -> list[Any]:
    """A streamed answer's data events (the final [DONE] as the string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in reply.text.splitlines() if line.startswith("data: ")]


def assert_answered(reply: httpx.Response) -> None:
    """Below 500; a refusal carries OpenAI's error object with a message; a stream ends with [DONE] and carries no
    server error."""
    assert reply.status_code < 500, reply.text[:3000]
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), reply.text
        assert error["type"] == "invalid_request_error", reply.text
    elif reply.headers["content-type"].startswith("text/event-stream"):
        sent = events(reply)
        assert sent and sent[-1] == "[DONE]", reply.text[-2000:]
        assert not [e for e in sent if isinstance(e, dict) and e.get("error", {}).get("type") == "server_error"], \
            reply.text[-3000:]


# ---- strategies -------------------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "NaN", "inf", "-1", "1e999", "x" * 5000, LONE_SURROGATE, DEEP, "{", "null", "user"]),
    st.text(max_size=12),
)
JUNK = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=8)

_BAD_MESSAGES = [
    [], [{}], "hi", [None], [{"role": "bogus", "content": "x"}], [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": ["x"]}], [{"role": "user", "content": [None]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": [1]}]}],
    [{"role": "user", "content": []}], [{"role": "user", "content": LONE_SURROGATE}],
    [{"role": "user", "content": "x" * 3000}], [{"role": "tool", "content": "x"}],
    [{"role": "assistant", "content": None}], [{"role": "assistant", "content": None, "tool_calls": []}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
    [{"role": "user", "content": "x", "name": {"deep": [[[1]]]}}],
    [{"role": "user", "content": "x", "tool_call_id": 5}],
]
_BAD_SCHEMAS = [
    DEEP, "{", "[1]", {"type": "bogus"}, {"type": 5}, {"$ref": "#/nope"},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "string", "pattern": "("}, {"type": "string", "pattern": NEVER}, {"not": {}}, {"enum": []},
    {"x-guidance": {"whitespace_flexible": "yes"}}, {"type": "string", "maxLength": 10**18},
    {"type": "object", "x": DEEP},
]
_COMMON: dict[str, list[Any]] = {
    "model": ["nope", "", 5, None, ["tiny"]],
    "max_tokens": [0, -1, 10**6, 2**63, 1.5, "4", True, None],
    "n": [0, -1, 17, 10**9, 2.5],
    "temperature": [-0.1, 2.01, "NaN", math.nan, math.inf, 1e-300],
    "top_p": [0, 0.0, 1.01, -1, math.nan, 5e-324],
    "top_k": [-2, 10**30, 0.5, 1],
    "seed": [-(2**70), 2**70, 2**64, -1, 1.5],
    "stop": [[["a"]], [""], "", ["a"] * 5, [None], ["x" * 5000], {"a": 1}],
    "stop_token_ids": [[-1], [10**9], [[1]], ["1"], [2**70]],
    "logit_bias": [{"x": 1}, {"1": 101}, {"-1": 1}, {"99999": 1}, {"1": math.nan}, {"1": "a"}, {"1.5": 1},
                   {" 1": 1}, {"\u0661": 1}, {str(10**30): 1}, [1], {"2": -100, "3": 100}],
    "min_tokens": [-1, 10**6, 100, 1.5],
    "presence_penalty": [2.5, -3, math.nan, "1"],
    "frequency_penalty": [2.5, -3, math.inf],
    "ignore_eos": ["maybe", 2],
    "stream": ["yes", 2, None],
    "stream_options": [{"include_usage": "x"}, [], "yes", {"include_usage": True}],
    "response_format": [{"type": "json_schema"}, {"type": "bogus"}, {"type": "text", "json_schema": {"name": "x"}},
                        *({"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in _BAD_SCHEMAS),
                        {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}],
    "structured_outputs": [{}, {"regex": "a", "choice": ["b"]}, {"json": DEEP}, {"grammar": "bad ::="},
                           {"bogus": 1}, {"regex": NEVER}, {"choice": []}, {"json_object": "x"}],
    "guided_json": _BAD_SCHEMAS,
    "guided_regex": ["(", NEVER, "a{2,1}", "\\", "(?=a)", "\\p{Bogus}", 5],
    "guided_choice": [[], [""], [1], "a", [LONE_SURROGATE]],
    "guided_grammar": ["", "start: ", "%%", "start: a\na: /[^\\s\\S]/", "root ::= ("],
    "guided_whitespace_pattern": [" ", ""],
    "cache_salt": ["", LONE_SURROGATE, 5],
    "kv_transfer": [{"mode": "bogus"}, {"mode": "decode"}, {"mode": "pull", "source": "ftp://x", "tokens": 1},
                    {"mode": "prefill", "ttl_seconds": -1}, {"mode": "prefill", "ttl_seconds": 1e9},
                    {"mode": "prefill", "extra": 1}, {"mode": "decode", "source": "http://127.0.0.1:1", "handle": "h",
                                                      "first_token": 10**9}],
    "resume_output_ids": [[-1], [10**9], [1] * 200, "x", [[1]]],
    "return_token_ids": ["x"],
}
CHAT_FIELDS: dict[str, list[Any]] = {
    **_COMMON,
    "messages": _BAD_MESSAGES,
    "max_completion_tokens": [0, -5, 10**9],
    "logprobs": [-1, 5, "yes"],
    "top_logprobs": [-1, 21, 5, 2.5],
    "tools": [[{"type": "function", "function": {"name": "f f"}}], [{"type": "x"}], [{}], "f", [TOOLS[0], TOOLS[0]],
              *([{"type": "function", "function": {"name": "f", "parameters": s}}] for s in _BAD_SCHEMAS[:6])],
    "tool_choice": ["required", "bogus", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 5],
    "parallel_tool_calls": ["x"],
}
COMPLETION_FIELDS: dict[str, list[Any]] = {
    **_COMMON,
    "prompt": [[], [[]], [-1], [10**9], [[1], []], "", LONE_SURROGATE, ["a", 1], [1.5], [None], "x" * 3000, [1] * 200,
               [LONE_SURROGATE], {"text": "x"}],
    "logprobs": [-1, 6, True, "yes"],
    "echo": [True, "x"],
    "suffix": ["x", 5],
}
CHAT_BASES = [
    {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "Hi"}]}],
     "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2},
    {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4, "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4, "tools": TOOLS, "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4, "tools": TOOLS,
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": [{"role": "user", "content": "Pick"}], "max_tokens": 3, "guided_choice": ["yes", "no"]},
    {"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 4, "response_format": {"type": "json_object"}},
]
COMPLETION_BASES = [
    {"prompt": "Once upon a time", "max_tokens": 2},
    {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 2, "seed": 7, "stop": ["\n"]},
    {"prompt": ["a", "b"], "max_tokens": 1, "n": 2, "ignore_eos": True},
    {"prompt": "x", "max_tokens": 3, "guided_regex": "[a-z]{1,3}", "min_tokens": 1},
]


@st.composite
def almost_valid(draw: st.DrawFn, bases: list[dict[str, Any]], fields: dict[str, list[Any]]) -> dict[str, Any]:
    """A valid body with one or two fields replaced by a bad value (a known one for the field, or any JSON), or
    dropped; streamed or not."""
    body = dict(draw(st.sampled_from(bases)))
    body["stream"] = draw(st.booleans())
    for _ in range(draw(st.integers(1, 2))):
        field = draw(st.sampled_from(sorted(fields)))
        if draw(st.integers(0, 9)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(st.one_of(st.sampled_from(fields[field]), JUNK))
    return body


# ---- properties -------------------------------------------------------------------------------------------------


@FUZZ
@given(body=almost_valid(CHAT_BASES, CHAT_FIELDS))
def test_chat_completions_answer_almost_valid_bodies(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_answered(post(http, "/v1/chat/completions", body))


@FUZZ
@given(body=almost_valid(COMPLETION_BASES, COMPLETION_FIELDS),
       headers=st.dictionaries(st.sampled_from(["x-kvmesh-priority", "x-kvmesh-workload"]),
                               st.one_of(st.text(string.printable.strip(), max_size=30),
                                         st.integers(-(2**100), 2**100).map(str)), max_size=2))
def test_completions_answer_almost_valid_bodies(http: httpx.Client, body: dict[str, Any],
                                                headers: dict[str, str]) -> None:
    assert_answered(http.post("/v1/completions", content=json.dumps(body, allow_nan=True),
                              headers={"content-type": "application/json", **headers}))


TOKENIZE_FIELDS: dict[str, list[Any]] = {
    "prompt": ["", LONE_SURROGATE, 5, ["a"], "x" * 5000], "messages": _BAD_MESSAGES, "model": ["nope", 5],
    "tools": CHAT_FIELDS["tools"], "add_generation_prompt": ["x"], "add_special_tokens": [2],
}


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_tokenize_and_detokenize_answer_almost_valid_bodies(http: httpx.Client, data: st.DataObject) -> None:
    tokenize = data.draw(almost_valid([{"prompt": "Hello"}, {"messages": [{"role": "user", "content": "Hi"}],
                                                             "tools": TOOLS}], TOKENIZE_FIELDS))
    tokenize.pop("stream")
    assert_answered(post(http, "/tokenize", tokenize))
    tokens = data.draw(st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=4), JUNK))
    assert_answered(post(http, "/detokenize", {"tokens": tokens, **data.draw(st.sampled_from([{}, {"model": 5}]))}))


ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter",
             "/v1/unload_lora_adapter", "/v1/kv/fetch"]


@settings(FUZZ, max_examples=40)
@given(path=st.sampled_from(ENDPOINTS),
       raw=st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"{", b"null", b"[]", b"5", b'"x"', b"\xff\xfe",
                                                              b"[" * 100000, b'{"a": NaN}', b'{"prompt": "\\ud800"}']),
                     JUNK.map(lambda v: json.dumps(v, allow_nan=True).encode())))
def test_every_endpoint_refuses_what_is_not_a_json_object(http: httpx.Client, path: str, raw: bytes) -> None:
    assert_answered(http.post(path, content=raw, headers={"content-type": "application/json"}))


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_adapter_and_kv_endpoints_answer_junk_fields(http: httpx.Client, data: st.DataObject) -> None:
    """LoRA loading reads nothing for a path that is no adapter; a fetch of unknown hashes sends nothing; a warm-up
    from a peer that refuses counts its chains as failed."""
    value = data.draw(JUNK)
    assert_answered(post(http, "/v1/load_lora_adapter", {"lora_name": data.draw(st.sampled_from(["a", "", "../x", 5])),
                                                         "lora_path": value}))
    assert_answered(post(http, "/v1/unload_lora_adapter", {"lora_name": value}))
    fetch = post(http, "/v1/kv/fetch", {"block_hashes": data.draw(st.one_of(st.lists(st.integers(-(2**70), 2**70),
                                                                                          max_size=3), JUNK)),
                                        "handle": data.draw(st.one_of(st.none(), JUNK))})
    assert_answered(fetch)
    chains = data.draw(st.one_of(st.lists(st.lists(st.integers(-(2**70), 2**70), max_size=3), max_size=2), JUNK))
    assert_answered(post(http, "/v1/kv/warm", {"source": data.draw(st.one_of(st.just(DEAD_PEER), JUNK)),
                                               "chains": chains}))


@st.composite
def valid_edges(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A valid request with many fields at once at the edges of their ranges (sampling, penalties, logit_bias,
    stops, logprobs, n, streaming with usage, and a structured output or a tool_choice), small max_tokens."""
    words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=3)
    body: dict[str, Any] = {
        "max_tokens": draw(st.integers(1, 4)), "n": draw(st.integers(1, 3)), "stream": draw(st.booleans()),
        "temperature": draw(st.one_of(st.just(0.0), st.floats(0.0, 2.0))),
        "top_p": draw(st.one_of(st.just(1.0), st.floats(1e-9, 1.0))), "top_k": draw(st.integers(-1, 60000)),
        "seed": draw(st.one_of(st.none(), st.integers(-(2**70), 2**70))),
        "presence_penalty": draw(st.floats(-2.0, 2.0)), "frequency_penalty": draw(st.floats(-2.0, 2.0)),
        "logit_bias": draw(st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100.0, 100.0), max_size=4)),
        "stop": draw(st.one_of(st.none(), words, st.lists(words, max_size=4))),
        "stop_token_ids": draw(st.lists(st.integers(0, 49151), max_size=3)),
        "ignore_eos": draw(st.booleans()), "return_token_ids": draw(st.booleans()),
    }
    if body["stream"]:  # refused without a stream, as OpenAI refuses it
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    body["min_tokens"] = draw(st.integers(0, body["max_tokens"]))
    constraint = draw(st.sampled_from([{}, {"guided_choice": ["yes", "no"]}, {"guided_regex": "[0-9]{1,4}"},
                                       {"response_format": {"type": "json_object"}},
                                       {"structured_outputs": {"json": TOOLS[0]["function"]["parameters"]}},
                                       {"guided_grammar": 'start: "a" | "b" start'}]))
    if chat:
        body["messages"] = [{"role": "user", "content": draw(words)}]
        body["logprobs"] = draw(st.booleans())
        body["top_logprobs"] = draw(st.integers(0, 20)) if body["logprobs"] else None
        tools = draw(st.sampled_from([{}, {"tools": TOOLS, "tool_choice": draw(st.sampled_from(
            ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}])),
            "parallel_tool_calls": draw(st.booleans())}]))
        body |= tools or constraint
        if not tools and not constraint:
            body |= draw(transfers(body))
    else:
        text = st.text(st.characters(categories=("L", "N")), min_size=1, max_size=8)  # no text encoding to nothing
        body["prompt"] = draw(st.one_of(text, st.lists(st.integers(0, 49151), min_size=1, max_size=8)))
        body["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 5)))
        body |= constraint or draw(transfers(body))
    return body


@st.composite
def transfers(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """None, a KV pull or handoff from a peer that refuses (the request computes what it could not pull), or a
    continuation after tokens generated elsewhere (EOS and stop tokens among them, maybe)."""
    mode = draw(st.sampled_from([None, "pull", "decode", "resume"]))
    if mode == "resume":
        body["max_tokens"] = max(body["max_tokens"], 2)
        ids = st.one_of(st.integers(0, 49151), st.sampled_from([0, 1, 2, *body["stop_token_ids"]]))
        return {"resume_output_ids": draw(st.lists(ids, min_size=1, max_size=body["max_tokens"] - 1))}
    if mode == "pull":
        return {"kv_transfer": {"mode": "pull", "source": DEAD_PEER, "tokens": draw(st.integers(1, 300))}}
    if mode == "decode":
        body["max_tokens"] = max(body["max_tokens"], 2)  # the first token is the prefill pod's
        return {"kv_transfer": {"mode": "decode", "source": DEAD_PEER, "handle": draw(st.text(max_size=8)),
                                "first_token": draw(st.integers(0, 49151))}}
    return {}


@settings(FUZZ, max_examples=40)
@given(body=valid_edges(chat=True))
def test_chat_completions_answer_valid_bodies_at_the_edges(http: httpx.Client, body: dict[str, Any]) -> None:
    """Not a search for 400s: every one of these is served, with one finished choice per `n`."""
    assert_served(post(http, "/v1/chat/completions", body), body["n"])


@settings(FUZZ, max_examples=40)
@given(body=valid_edges(chat=False))
def test_completions_answer_valid_bodies_at_the_edges(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_served(post(http, "/v1/completions", body), body["n"])


def assert_served(reply: httpx.Response, n: int) -> None:
    assert reply.status_code == 200, reply.text[:3000]
    assert_answered(reply)
    if reply.headers["content-type"].startswith("text/event-stream"):
        choices = [c for e in events(reply)[:-1] for c in e["choices"] if c["finish_reason"] is not None]
    else:
        choices = reply.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(n)), reply.text[-3000:]


# ---- regressions the search found --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("field", "value"), [("guided_regex", NEVER), ("guided_grammar", "start: a\na: /[^\\s\\S]/"),
                                              ("structured_outputs", {"regex": NEVER})])
def test_a_constraint_that_allows_no_output_is_a_400(http: httpx.Client, field: str, value: Any,
                                                     stream: bool) -> None:
    """Was a 500 (or a streamed server error): the first mask failed on the engine thread."""
    reply = post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value, "stream": stream})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and "allows no output" in error["message"] and "<state>" not in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_failing_mid_generation_is_the_requests_error(http: httpx.Client, stream: bool) -> None:
    """A grammar past llguidance's limits fails after its first token: a 400 naming the field (an error event of
    the same type in a stream), not a 500 engine_error with the matcher's state dumped into it."""
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "guided_regex": "a{1000000000}", "stream": stream}
    reply = post(http, "/v1/completions", body)
    if stream:
        assert reply.status_code == 200
        error = next(e["error"] for e in events(reply) if isinstance(e, dict) and "error" in e)
    else:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_regex"
    assert "structured output failed" in error["message"] and "<state>" not in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_yields_to_a_constraint_that_allows_only_stop_tokens(served: tuple[str, Engine],
                                                                       http: httpx.Client, stream: bool) -> None:
    """Was a 500: min_tokens masked the only token the choice allows (a stop token), so the sampler drew a token
    the matcher refused. The constraint wins: the output ends there."""
    (a,) = served[1].tokenizer.encode("a", add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "guided_choice": ["a"],
            "stop_token_ids": [a], "min_tokens": 2, "stream": stream}
    reply = post(http, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    if stream:
        assert [e["choices"][0]["finish_reason"] for e in events(reply)[:-1]][-1] == "stop"
    else:
        assert reply.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_json": DEEP}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": DEEP}}]}, {"role": "user", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": DEEP}}]}]}, "messages"),
])
def test_json_text_nested_too_deeply_is_a_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    """Was a 500 (RecursionError from json.loads) and a dropped keep-alive connection."""
    reply = post(http, path, {**body, "max_tokens": 1} if path != "/tokenize" else body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and "nest" in reply.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "\ud800"}, "cache_salt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_text_that_is_not_unicode_is_a_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    """Was a 500: a lone surrogate (the json module reads the escape) reached the tokenizer, which cannot encode it.
    The body's reader (openai_types.read_json, the router's too) refuses the escape, saying where; a body built
    in Python is refused by the field's own check, naming it."""
    reply = post(http, path, {**body, "max_tokens": 1} if path != "/tokenize" else body)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("body: malformed JSON: ") and ("surrogate" in message or "hex escape" in message)
    model = TokenizeRequest if path == "/tokenize" else ChatRequest if "chat" in path else CompletionRequest
    with pytest.raises(ValidationError) as refused:
        model.model_validate(body)
    assert str(refused.value.errors()[0]["loc"][0]) == param and "Unicode" in str(refused.value)


def test_tool_call_parsers_skip_what_is_not_a_call() -> None:
    """A model may write a call whose name is not a string (a TypeError hashing it was a 500) or whose JSON nests
    past the recursion limit: neither is a call, and neither fails the answer."""
    names = {"f"}
    assert parse_hermes('<tool_call>{"name": ["f"], "arguments": {}}</tool_call>', names) == []
    assert parse_hermes('<tool_call>{"name": {"a": 1}}</tool_call>', names) == []
    assert parse_hermes(f'<tool_call>{{"name": "f", "arguments": {DEEP}', names) == []
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>', names) == []
    assert [c.name for c in parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>', names)] == ["f"]
    required = ToolStream("required", names)
    assert required.feed('[{"name": ["f"], "arguments": {}}, {"name": "f", "arguments": ' + DEEP).tool_calls == []


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 2, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_sampling_errors_name_their_parameter(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    reply = post(http, "/v1/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("priority", [str(2**31), str(-2**31 - 1), str(2**63)])
def test_a_priority_outside_the_contract_s_range_is_a_400(http: httpx.Client, priority: str) -> None:
    """engine/protocol.parse_priority's range, the router's too (its request log's integer column holds it)."""
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"x-kvmesh-priority": priority})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "x-kvmesh-priority"


def test_the_frameworks_own_refusals_are_openai_errors(http: httpx.Client) -> None:
    """A path nobody serves and another method, in the error shape clients read; the 405 keeps its Allow header
    (openai_types.http_error_handler, the router's too)."""
    missing, wrong = http.get("/v1/nothing-here"), http.get("/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] and wrong.headers["allow"] == "POST"


def test_malformed_json_is_named_as_such_not_as_a_field(http: httpx.Client) -> None:
    """Its error says where the fault is, in no field: it was reported as param "1"."""
    error = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert error.status_code == 400
    assert error.json()["error"]["param"] is None
    assert error.json()["error"]["message"].startswith("body: malformed JSON: ")
    assert "line 1 column 11" in error.json()["error"]["message"]


def test_missing_content_names_its_message(http: httpx.Client) -> None:
    """The template counted the tools prompt it prepends, so the error named messages[1] for the only message."""
    body = {"messages": [{"role": "user", "content": None}], "tools": TOOLS, "max_tokens": 1}
    error = post(http, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "messages" and error["message"].startswith("messages.0:")


def test_refused_tools_are_the_only_error(http: httpx.Client) -> None:
    """A named tool_choice was also reported as naming a function 'not in tools ()' when the tools were refused."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    error = post(http, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "tools" and "tool_choice" not in error["message"]


@pytest.mark.parametrize(("prompts", "n"), [(8, MAX_N), (MAX_SEQUENCES_PER_REQUEST, 1)])
def test_a_request_starts_at_most_its_bound_of_sequences(http: httpx.Client, prompts: int, n: int) -> None:
    """A list of prompts times n, each one sequence: the bound is served whole, one past it (a prompt more) is a
    400 naming both fields and the bound, before anything is queued."""
    body = {"prompt": [[5, 6 + i] for i in range(prompts)], "n": n, "max_tokens": 1, "temperature": 0}
    served = post(http, "/v1/completions", body)
    assert served.status_code == 200 and len(served.json()["choices"]) == MAX_SEQUENCES_PER_REQUEST, served.text
    refused = post(http, "/v1/completions", {**body, "prompt": [*body["prompt"], [7]]})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "prompt", refused.text
    assert f"{prompts + 1} prompts with n={n}" in error["message"]
    assert f"at most {MAX_SEQUENCES_PER_REQUEST} (prompts x n)" in error["message"]


def grammar_of(chars: int) -> str:
    """A Lark grammar of exactly `chars` characters: 1,000 alternatives (under llguidance's 2,000 items a parser
    row may hold, which it refuses with a plain 400 of its own), each a literal as long as the length asks."""
    head, alternatives = "start: ", 1000
    width = (chars - len(head) - 3 * (alternatives - 1)) // alternatives - 2  # ' | ' between, quotes around
    grammar = head + " | ".join(f'"{i:04d}{"x" * (width - 4)}"' for i in range(alternatives))
    return grammar + " " * (chars - len(grammar))


AT_BOUND = [f"{i:04d}" + "x" * (MAX_CHOICES_CHARS // MAX_CHOICES - 4) for i in range(MAX_CHOICES)]


@pytest.mark.parametrize(("field", "at_bound", "past_bound", "bound"), [
    ("guided_choice", AT_BOUND, [*AT_BOUND, "y"], f"at most {MAX_CHOICES} items"),  # one choice more
    ("guided_choice", AT_BOUND, [*AT_BOUND[:-1], AT_BOUND[-1] + "y"], f"at most {MAX_CHOICES_CHARS}"),  # a character
    ("guided_choice", AT_BOUND, [f"option {i}" for i in range(100_000)], f"at most {MAX_CHOICES} items"),
    ("guided_grammar", grammar_of(MAX_GRAMMAR_CHARS), grammar_of(MAX_GRAMMAR_CHARS + 1),
     f"at most {MAX_GRAMMAR_CHARS} characters"),
])
def test_a_constraint_past_its_size_bound_is_a_plain_400(http: httpx.Client, field: str, at_bound: Any,
                                                         past_bound: Any, bound: str) -> None:
    """At the bound the constraint compiles and is served; past it the 400 names the field and the bound before
    llguidance runs: 100,000 choices took it half a minute and ended in a panic with its backtrace in the message."""
    body = {"prompt": "x", "max_tokens": 1, "temperature": 0}
    served = post(http, "/v1/completions", {**body, field: at_bound})
    assert served.status_code == 200, served.text[:2000]
    refused = post(http, "/v1/completions", {**body, field: past_bound})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == field and bound in error["message"], refused.text[:2000]
    assert not any(word in error["message"] for word in ("panic", "backtrace", "<state>")), error["message"]


def test_structured_outputs_choices_share_the_bound(http: httpx.Client) -> None:
    reply = post(http, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                           "structured_outputs": {"choice": ["a"] * (MAX_CHOICES + 1)}})
    assert reply.status_code == 400 and f"at most {MAX_CHOICES} items" in reply.json()["error"]["message"]


def test_the_engine_is_idle_with_its_kv_intact_after_all_of_it(served: tuple[str, Engine]) -> None:
    """Last in the module: no request was left running or waiting, and no block is held."""
    wait_idle(served[1])
    served[1].kv.check_invariants()
