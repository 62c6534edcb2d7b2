"""The router's HTTP edge under bad input: almost-valid requests (a valid one with a field or two of the wrong type
or range), bodies that are not JSON objects, odd headers, broken uploads and Batch API calls with bad values. Every
answer is below 500, every 4xx says why in OpenAI's error shape, and afterwards nothing is left in flight, the
request log lost nothing and a valid request is still served. One keyed router with a SQLite database in front of
the tiny model's engine, in this process; the draws are fixed (derandomized), the examples bounded."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.openai_types import MAX_N, MAX_SEQUENCES_PER_REQUEST
from kvmesh.engine.protocol import PRIORITY_HEADER, WORKLOAD_HEADER
from kvmesh.router.app import Router, build_router
from kvmesh.router.auth import hash_key
from kvmesh.router.batches import CHAT_PATH, COMPLETIONS_PATH, check_input, jsonl
from kvmesh.router.config import RouterConfig

from .conftest import make_engine, short_id
from .engines import serve_engine, serve_router

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LONG_TEXT = "lorem ipsum " * 6000  # 72 kB: past the inline tokenize bound, and more tokens than the model's context


class Pool:
    """The router under test. Not a dataclass: a failing example names it by URL, not by the router's state."""

    def __init__(self, url: str, router: Router, http: httpx.Client, failing_file: str) -> None:
        self.url, self.router, self.http = url, router, http
        self.failing_file = failing_file  # a batch input whose batches fail their check: they run no request

    def __repr__(self) -> str:
        return f"Pool({self.url})"


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    folder = tmp_path_factory.mktemp("fuzz")
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": "team", "key_sha256": hash_key(KEY)}]}))
    engine = make_engine(tiny_dir, kv_cache_blocks=128, max_model_len=512)
    with serve_engine(engine) as engine_url:
        router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, api_keys_file=str(keys),
                                           database_url=f"sqlite:///{folder / 'pool.db'}"), tiny_dir)
        with serve_router(router) as url, httpx.Client(base_url=url, timeout=60) as http:
            _wait_serving(http)
            bad_line = jsonl([{"custom_id": "a", "method": "GET", "url": CHAT_PATH, "body": {}}])
            uploaded = http.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", bad_line)})
            assert uploaded.status_code == 200, uploaded.text
            yield Pool(url, router, http, uploaded.json()["id"])


def _wait_serving(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while not http.get("/v1/models", headers=AUTH).json()["data"]:
        assert time.monotonic() < deadline, "the router never saw its engine"
        time.sleep(0.05)


def sane(reply: httpx.Response) -> None:
    """Below 500, and a refusal says why as OpenAI does: {"error": {"message": ...}}."""
    assert reply.status_code < 500, (reply.status_code, reply.text[:2000])
    if reply.status_code >= 400:
        error = reply.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], reply.text


def settled(pool: Pool) -> None:
    """No request left in flight: every pod's count and every tenant's back to zero (a stream's relay gives its
    booking back just after the client read its end, so this waits a moment for it)."""
    router = pool.router
    deadline = time.monotonic() + 10
    while (any(p.inflight for p in router.pods.pods.values()) or router.limits.inflight
           or router.limits.batch.inflight):
        assert time.monotonic() < deadline, (f"left in flight: pods {[p.inflight for p in router.pods.pods.values()]}"
                                             f", tenants {router.limits.inflight}, {router.limits.batch.inflight}")
        time.sleep(0.01)


def still_serves(pool: Pool) -> None:
    """After the fuzz: a valid request is served, nothing is in flight and the request log dropped no row."""
    for path, body in ((CHAT_PATH, CHAT), (COMPLETIONS_PATH, COMPLETION)):
        reply = pool.http.post(path, json=body, headers=AUTH)
        assert reply.status_code == 200, reply.text
    settled(pool)
    log = pool.router.log
    assert log is not None
    log.flush()
    assert (log.errors, log.dropped) == (0, 0), "the request log dropped rows"


def post_json(pool: Pool, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return pool.http.post(path, content=encode(body),
                          headers={**AUTH, "content-type": "application/json", **(headers or {})})


# ---- the values a field is replaced with ------------------------------------------------------------------------

# ints outside any sensible range: never a valid mid-range max_tokens, so no example generates for long
BAD_INTS = st.one_of(st.integers(min_value=-2**70, max_value=0), st.integers(min_value=2**31, max_value=2**80))
JSON_LEAVES = st.one_of(st.none(), st.booleans(), BAD_INTS, st.floats(), st.text(max_size=12),
                        st.sampled_from(["", LONG_TEXT, "\x00", "\ud800", "\u2028", "🦙" * 3]))
WEIRD = st.one_of(
    JSON_LEAVES,
    st.lists(JSON_LEAVES, max_size=3),
    st.dictionaries(st.text(max_size=6), JSON_LEAVES, max_size=3),
    st.sampled_from([[], {}, [[]], [{}], {"type": "text"}, [None]]),
)
MESSAGE_VALUES = [
    "hi", [], [{}], [None], ["hi"], [{"role": "wizard", "content": "hi"}], [{"role": "user"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": 5}], [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": [5]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "hi", "name": {"a": 1}}], [{"role": "user", "content": "hi", "tool_calls": 5}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": {}}}]}],
    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": [1]}}]}],
    [{"role": "user", "content": "hi", "tool_call_id": 5}], [{"role": "system", "content": "x"}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": LONG_TEXT}],
]


class Nested(str):
    """A list nested `depth` deep, as JSON text (`encode` writes it; json.dumps could not): a parser may take it
    whole, and a recursive walk of it (checking, forwarding) may still run out of stack."""

    def __new__(cls, depth: int) -> Nested:
        return super().__new__(cls, f"<nested {depth}>")

    def __init__(self, depth: int) -> None:
        self.depth = depth


def encode(body: Any) -> bytes:
    """`body` as JSON text as Python writes it (NaN and Infinity included: clients send them), with its Nested."""
    text = json.dumps(body)
    for deep in _nested_in(body):
        text = text.replace(json.dumps(deep), "[" * deep.depth + "]" * deep.depth, 1)
    return text.encode()


def _nested_in(value: Any) -> Iterator[Nested]:
    if isinstance(value, Nested):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _nested_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _nested_in(item)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FIELD_VALUES: dict[str, list[Any]] = {
    "model": [5, "", "no-such-model", ["m"], {"id": "m"}, "\ud800", "m" * 10_000],
    "messages": MESSAGE_VALUES,
    "prompt": ["", [], [""], [[]], [[1, 2], []], [1, -1], [10**9], [[10**9]], [[1], [10**9]], ["a", 5], [1.5],
               [True], "\ud800", LONG_TEXT, [LONG_TEXT, "a"], [[2**64]]],
    "stream": ["true", "1", 1, "yes", "no", "maybe", 2, [], {}],
    "stream_options": [{"include_usage": "yes"}, {"include_usage": None}, {"include_usage": 2}, [], "x", {"x": 1},
                       {"include_usage": True, "continuous_usage_stats": True}],
    "n": [0, 17, 2, "2", 2.0, 2.5, -1],
    "stop": [[""], "", ["a"] * 100, [5], [None], {"a": 1}, "\ud800"],
    "stop_token_ids": [[-1], [10**9], [2**64], ["a"], [None]],
    "logit_bias": [{"x": 1}, {"1": 1e9}, {"99999999": 1}, {"-1": 1}, {"1": "a"}, [], {" 1 ": 1}, {"１": 1},
                   {"1": float("nan")}, {"1": float("inf")}],
    "response_format": [{"type": "json_schema"}, {"type": "nope"}, {"type": "json_schema", "json_schema": 5},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "json",
                        {"type": "json_object", "extra": 1}],
    "tools": [[{}], [TOOL, TOOL], [{"type": "function", "function": {"name": "bad name!"}}], {"f": 1}, [5],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]],
    "tool_choice": ["sometimes", {"type": "function", "function": {"name": "g"}}, {"type": "function"}, 5],
    "guided_json": [{"type": "nope"}, "not json", 5, [1]],
    "guided_regex": ["(", "[", "a{99999}", 5],
    "guided_choice": [[], [5], "a", [""]],
    "guided_grammar": ["root ::= ", "(", 5],
    "structured_outputs": [{}, {"regex": "a", "choice": ["a"]}, {"json": 5}, {"nope": 1}, []],
    "cache_salt": ["", 5, []],
    "kv_transfer": [{"mode": "decode", "source": "http://127.0.0.1:1"}, "pull", 5],
    "resume_output_ids": [[1, 2], [-1], "x"],
    "top_logprobs": [-1, 21, 10**9, "1"],
    "logprobs": [-1, 6, 10**9, "yes", 2.5],
    "unknown_field": [Nested(100), Nested(900), Nested(960), Nested(990), Nested(5000)],
}
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
               "stream", "stream_options", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens",
               "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "structured_outputs",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern", "user",
               "cache_salt", "kv_transfer", "resume_output_ids", "return_token_ids", "logprobs", "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls", "unknown_field"]
COMPLETION_FIELDS = [f for f in CHAT_FIELDS if f not in ("messages", "max_completion_tokens", "top_logprobs", "tools",
                                                         "tool_choice", "parallel_tool_calls")]
COMPLETION_FIELDS += ["prompt", "echo", "suffix"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}


def value_for(field: str) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(FIELD_VALUES[field]), WEIRD) if field in FIELD_VALUES else WEIRD


@st.composite
def almost(draw: st.DrawFn, valid: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """`valid` with one or two of `fields` replaced by a wrong value (or, for a message, one of its keys)."""
    body = json.loads(json.dumps(valid))
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        body[field] = draw(value_for(field))
    if "messages" in valid and isinstance(body.get("messages"), list) and draw(st.booleans()):
        message_key = draw(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "weight"]))
        body["messages"] = [{**CHAT["messages"][0], message_key: draw(WEIRD)}]
    return body


# ---- completions --------------------------------------------------------------------------------------------------


@FUZZ
@given(body=almost(CHAT, CHAT_FIELDS), stream=st.booleans())
def test_almost_valid_chat_requests_are_refused_or_served_never_failed(pool: Pool, body: dict[str, Any],
                                                                       stream: bool) -> None:
    sane(post_json(pool, CHAT_PATH, {"stream": stream, **body}))
    settled(pool)


@FUZZ
@given(body=almost(COMPLETION, COMPLETION_FIELDS), stream=st.booleans())
def test_almost_valid_completions_are_refused_or_served_never_failed(pool: Pool, body: dict[str, Any],
                                                                     stream: bool) -> None:
    sane(post_json(pool, COMPLETIONS_PATH, {"stream": stream, **body}))
    settled(pool)


@pytest.mark.parametrize(("path", "field", "value"), [
    (path, field, value) for path, valid, fields in ((CHAT_PATH, CHAT, CHAT_FIELDS),
                                                     (COMPLETIONS_PATH, COMPLETION, COMPLETION_FIELDS))
    for field in fields for value in FIELD_VALUES.get(field, [])], ids=lambda v: short_id(repr(v)))
def test_each_listed_bad_value_is_refused_or_served(pool: Pool, path: str, field: str, value: Any) -> None:
    """Every value listed for a field, once in each request it belongs in (the properties draw only some)."""
    sane(post_json(pool, path, {**(CHAT if path == CHAT_PATH else COMPLETION), field: value}))
    settled(pool)


def test_after_the_completion_fuzz_a_valid_request_is_served(pool: Pool) -> None:
    still_serves(pool)


POST_PATHS = [CHAT_PATH, COMPLETIONS_PATH, "/tokenize", "/detokenize", "/v1/batches"]
NOT_OBJECTS = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"null", b"[]", b"[1]", b"5", b'"x"', b"true", b"{", b"{}}", b'{"a":}', b"\xff\xfe{}",
                     b"\xef\xbb\xbf{}", '{"prompt": "hi"}'.encode("utf-16"), b"[" * 100_000 + b"]" * 100_000,
                     b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"prompt": "hi", "prompt": 5}', b"NaN",
                     b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}']),
    st.builds(lambda v: json.dumps(v).encode(), JSON_LEAVES),
)
CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "ünïcode/type"]


@FUZZ
@given(path=st.sampled_from(POST_PATHS), payload=NOT_OBJECTS, content_type=st.sampled_from(CONTENT_TYPES))
def test_bodies_that_are_not_json_objects_never_fail(pool: Pool, path: str, payload: bytes,
                                                      content_type: str | None) -> None:
    headers: dict[str, Any] = dict(AUTH)
    if content_type is not None:
        headers["content-type"] = content_type.encode("latin-1")
    sane(pool.http.post(path, content=payload, headers=headers))
    settled(pool)


@FUZZ
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"]),
       path=st.sampled_from([*POST_PATHS, "/v1/models", "/v1/files", "/v1/files/x/content", "/v1/batches/x/cancel",
                             "/v1/nope", "/", "/v1/chat/completions/", "/V1/MODELS", "/v1//models", "/tokenize/x"]))
def test_other_methods_and_paths_are_refused_in_openai_shape(pool: Pool, method: str, path: str) -> None:
    reply = pool.http.request(method, path, headers=AUTH, content=encode(COMPLETION))
    if method != "HEAD":  # a HEAD answer has no body to say why in
        sane(reply)
    assert reply.status_code < 500
    settled(pool)


# ---- headers ------------------------------------------------------------------------------------------------------

# what a header value can carry on the wire: visible ASCII, tab, space and Latin-1's upper half, not at its ends
HEADER_TEXT = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]) | st.just("\t"),
                      max_size=40).map(lambda text: text.strip(" \t"))
PRIORITIES = st.one_of(HEADER_TEXT, st.sampled_from(["1.5", "-1", "0 3", "1_000", "+2", "²", str(2**63),
                                                     str(-2**63), "9" * 4000, "9" * 5000, "0x10", "inf"]))
AUTHORIZATIONS = st.one_of(HEADER_TEXT, st.sampled_from(["", "Bearer", f"Basic {KEY}", KEY,
                                                         f"Bearer  {KEY}  x", f"bearer\t{KEY}", f"Bearer {KEY}é",
                                                         "Bearer ÿÿ", f"Bearer {hash_key(KEY)}"]))


def latin1(headers: dict[str, str | None]) -> dict[str, bytes]:
    return {name: value.encode("latin-1") for name, value in headers.items() if value is not None}


@FUZZ
@given(path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]), stream=st.booleans(),
       priority=st.none() | PRIORITIES, workload=st.none() | HEADER_TEXT,
       authorization=st.none() | AUTHORIZATIONS | st.just(f"Bearer {KEY}"))
def test_odd_headers_are_refused_or_ignored(pool: Pool, path: str, stream: bool, priority: str | None,
                                            workload: str | None, authorization: str | None) -> None:
    body = {**(CHAT if path == CHAT_PATH else COMPLETION), "stream": stream}
    headers = latin1({"authorization": authorization, PRIORITY_HEADER: priority, WORKLOAD_HEADER: workload,
                      "content-type": "application/json"})
    reply = pool.http.post(path, content=json.dumps(body).encode(), headers=headers)
    sane(reply)
    if authorization != f"Bearer {KEY}" and reply.status_code != 401:
        assert pool.router.keys.tenant_for(authorization) is not None, "a request without a valid key was served"
    settled(pool)


@FUZZ
@given(path=st.sampled_from(["/v1/models", "/v1/files", "/v1/batches", "/v1/batches/batch_x", "/v1/files/file-x"]),
       authorization=st.none() | AUTHORIZATIONS)
def test_every_endpoint_refuses_a_bad_key_with_401(pool: Pool, path: str, authorization: str | None) -> None:
    reply = pool.http.get(path, headers=latin1({"authorization": authorization}))
    sane(reply)
    if pool.router.keys.tenant_for(authorization) is None:
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


# ---- /tokenize and /detokenize ------------------------------------------------------------------------------------


@FUZZ
@given(call=st.one_of(
    st.tuples(st.just("/tokenize"), almost({"prompt": "hi"}, ["model", "prompt", "add_special_tokens", "messages",
                                                              "tools", "unknown_field"])),
    st.tuples(st.just("/tokenize"), almost({"messages": CHAT["messages"]}, ["model", "messages", "tools",
                                                                            "add_generation_prompt", "prompt"])),
    st.tuples(st.just("/detokenize"), almost({"tokens": [1, 2]}, ["model", "tokens", "unknown_field"])),
    st.tuples(st.just("/detokenize"), st.builds(lambda t: {"tokens": t}, st.lists(BAD_INTS | st.floats(),
                                                                                  max_size=3))),
))
def test_tokenize_and_detokenize_never_fail_on_bad_calls(pool: Pool, call: tuple[str, dict[str, Any]]) -> None:
    sane(post_json(pool, *call))


# ---- the Batch API ------------------------------------------------------------------------------------------------

FORM_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "batch", "batch_output", "²", "3600.0", "-1",
                                                             "99999999999999999999999", "7200", "created_at"]))


UPLOAD = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}


@FUZZ
@given(form=st.fixed_dictionaries({}, optional={**{name: FORM_TEXT for name in UPLOAD},
                                               "expires_after": FORM_TEXT, "expires_after[x]": FORM_TEXT}),
       dropped=st.lists(st.sampled_from(list(UPLOAD)), max_size=1),
       file_as=st.sampled_from(["file", "file", "text", "none", "two"]), content=st.binary(max_size=64))
def test_uploads_with_bad_fields_never_fail(pool: Pool, form: dict[str, str], dropped: list[str], file_as: str,
                                             content: bytes) -> None:
    data = {name: value for name, value in {**UPLOAD, **form}.items() if name not in dropped}
    files: list[tuple[str, Any]] = []
    if file_as in ("file", "two"):
        files = [("file", ("in.jsonl", content))] * (2 if file_as == "two" else 1)
    elif file_as == "text":
        data["file"] = content.decode("latin-1")
    if not files:  # httpx sends a form without files urlencoded: ask for multipart as a client would
        files = [("other", ("x", b""))]
    reply = pool.http.post("/v1/files", headers=AUTH, data=data, files=files)
    sane(reply)
    if reply.status_code == 200:
        pool.http.delete(f"/v1/files/{reply.json()['id']}", headers=AUTH)


@FUZZ
@given(content_type=st.sampled_from(["multipart/form-data", "multipart/form-data; boundary=", "multipart/form-data; "
                                     "boundary=b", "multipart/mixed; boundary=b", "application/json", None]),
       payload=st.one_of(st.binary(max_size=200), st.sampled_from([
           b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--b--\r\n",
           b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nx",
           b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n", b"--b--\r\n", b"--b\r\n\r\n",
           b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n" * 20 + b"--b--\r\n"])))
def test_broken_multipart_uploads_never_fail(pool: Pool, content_type: str | None, payload: bytes) -> None:
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    sane(pool.http.post("/v1/files", headers=headers, content=payload))


BATCH_FIELD_VALUES: dict[str, list[Any]] = {
    "endpoint": ["/v1/embeddings", "", "/v1/chat/completions/", "v1/chat/completions", None, 5],
    "completion_window": ["24", "0h", "169h", "24H", "1d", " 24h", "24h ", "²h", 24, 24.0, None, [], {}, ""],
    "metadata": [{str(i): "v" for i in range(17)}, {"k": 5}, {"k": None}, {"k" * 65: "v"}, {"k": "v" * 513}, [],
                 "m", {"k": {"a": "b"}}, {"": ""}, {"\x00": "\ud800"}],
    "output_expires_after": [{"anchor": "created_at", "seconds": "3600"}, {"anchor": "created_at"},
                             {"anchor": "created_at", "seconds": 3599}, {"anchor": "created_at", "seconds": True},
                             {"anchor": "created_at", "seconds": 3600.5}, {"anchor": "created_at", "seconds": "²"},
                             {"anchor": "now", "seconds": 3600}, [], "1h", 3600],
    "input_file_id": ["", "file-nope", 5, None, [], "\x00", "file-" + "x" * 10_000, "../../etc/passwd"],
}


@FUZZ
@given(data=st.data())
def test_batch_creations_with_bad_fields_never_fail(pool: Pool, data: st.DataObject) -> None:
    body: dict[str, Any] = {"input_file_id": pool.failing_file, "endpoint": CHAT_PATH, "completion_window": "24h"}
    for field in data.draw(st.lists(st.sampled_from(list(BATCH_FIELD_VALUES)), min_size=1, max_size=2, unique=True)):
        body[field] = data.draw(st.sampled_from(BATCH_FIELD_VALUES[field]) | WEIRD)
    reply = post_json(pool, "/v1/batches", body)
    sane(reply)
    if reply.status_code == 200:  # its input fails the check: it ends without a request; cancel it anyway
        sane(pool.http.post(f"/v1/batches/{reply.json()['id']}/cancel", headers=AUTH))


QUERY_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["0", "1", "100", "101", "10000", "10001", "-1", "²",
                                                              "1.5", "", " 5", "asc", "desc", "ASC", "\x00", "file-x",
                                                              "9" * 5000]))


@FUZZ
@given(path=st.sampled_from(["/v1/files", "/v1/batches"]),
       query=st.dictionaries(st.sampled_from(["limit", "after", "order", "purpose"]), QUERY_TEXT, max_size=3))
def test_list_calls_with_bad_query_values_never_fail(pool: Pool, path: str, query: dict[str, str]) -> None:
    sane(pool.http.get(path, params=query, headers=AUTH))


@FUZZ
@given(item_id=st.one_of(st.text(max_size=20), st.sampled_from(["", ".", "..", "\x00", "a/b", "batch_" + "x" * 5000,
                                                                 "%00", "file-x?y=1", "🦙"])),
       call=st.sampled_from([("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"), ("DELETE", "/v1/files/{}"),
                             ("GET", "/v1/batches/{}"), ("POST", "/v1/batches/{}/cancel")]))
def test_calls_on_malformed_ids_are_404s_not_failures(pool: Pool, item_id: str, call: tuple[str, str]) -> None:
    method, template = call
    reply = pool.http.request(method, template.format(urllib.parse.quote(item_id, safe="")), headers=AUTH)
    sane(reply)
    assert reply.status_code != 200 or item_id == pool.failing_file


def test_after_the_batch_fuzz_the_batch_api_still_works(pool: Pool) -> None:
    created = post_json(pool, "/v1/batches", {"input_file_id": pool.failing_file, "endpoint": CHAT_PATH,
                                              "completion_window": "24h", "metadata": {"k": "v"}})
    assert created.status_code == 200, created.text
    listed = pool.http.get("/v1/batches", params={"limit": 100}, headers=AUTH)
    assert listed.status_code == 200 and created.json()["id"] in [b["id"] for b in listed.json()["data"]]
    still_serves(pool)


# ---- the bugs the fuzz found, one test each ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH, "/v1/batches", "/tokenize"])
@pytest.mark.parametrize("depth", [990, 5000])
def test_a_body_nested_past_the_parsers_bound_is_a_400(pool: Pool, path: str, depth: int) -> None:
    """json.loads hit Python's recursion limit (a 500) at about 990 levels in the event loop, or parsed in a worker
    thread a body that then failed to serialize on its way to the pod: bodies are parsed with a fixed bound (or,
    past the bytes the pool counts for a conversation, refused before they are parsed at all)."""
    for body in (Nested(depth), {**COMPLETION, "messages": CHAT["messages"], "input_file_id": pool.failing_file,
                                 "endpoint": CHAT_PATH, "padding": "x" * 9000, "deep": Nested(depth)}):
        reply = post_json(pool, path, body)
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        if path != "/tokenize":  # pydantic's own words there
            assert "malformed JSON" in message or "bytes, the most this pool counts" in message
    settled(pool)


@pytest.mark.parametrize(("path", "field", "value"), [(CHAT_PATH, "temperature", 5), (COMPLETIONS_PATH, "n", 0)])
def test_a_field_the_router_refuses_is_named_in_param_as_the_engine_names_it(pool: Pool, path: str, field: str,
                                                                            value: int) -> None:
    body = {**(CHAT if path == CHAT_PATH else COMPLETION), field: value}
    reply = post_json(pool, path, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


@pytest.mark.parametrize("priority", [str(2**31), str(-2**31 - 1), str(2**63), "9" * 4000])
def test_a_priority_outside_the_request_log_s_column_is_a_400_and_the_log_loses_nothing(pool: Pool,
                                                                                   priority: str) -> None:
    """A priority past 2**63 was served, and its row failed the request log's batch write: up to 100 other
    requests' rows were dropped with it (PostgreSQL's INTEGER column fails from 2**31)."""
    reply = pool.http.post(COMPLETIONS_PATH, json=COMPLETION, headers={**AUTH, PRIORITY_HEADER: priority})
    assert reply.status_code == 400 and PRIORITY_HEADER in reply.json()["error"]["message"]
    assert pool.http.post(COMPLETIONS_PATH, json=COMPLETION, headers={**AUTH, PRIORITY_HEADER: str(2**31 - 1)}
                          ).status_code == 200
    still_serves(pool)


@pytest.mark.parametrize("window", [True, 24, 24.0, [], {}, None])
def test_a_completion_window_that_is_not_text_is_a_400(pool: Pool, window: Any) -> None:
    """re.match on a number or a list raised TypeError: a 500."""
    reply = post_json(pool, "/v1/batches", {"input_file_id": pool.failing_file, "endpoint": CHAT_PATH,
                                            "completion_window": window})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "completion_window", reply.text


@pytest.mark.parametrize("digits", ["²", "٣", "9" * 5000])
def test_numbers_int_refuses_are_400s_naming_their_param(pool: Pool, digits: str) -> None:
    """str.isdigit takes "²" and 5000 nines, which int() refuses (a ValueError: a 500): the list endpoints' limit,
    an upload's expires_after[seconds] and a batch's output_expires_after.seconds."""
    for path in ("/v1/files", "/v1/batches"):
        listed = pool.http.get(path, params={"limit": digits}, headers=AUTH)
        assert listed.status_code == 400 and listed.json()["error"]["param"] == "limit", listed.text
    uploaded = pool.http.post("/v1/files", headers=AUTH, files={"file": ("in.jsonl", b"{}\n")},
                              data={**UPLOAD, "expires_after[seconds]": digits})
    assert uploaded.status_code == 400 and uploaded.json()["error"]["param"] == "expires_after", uploaded.text
    created = post_json(pool, "/v1/batches", {"input_file_id": pool.failing_file, "endpoint": CHAT_PATH,
                                              "output_expires_after": {"anchor": "created_at", "seconds": digits}})
    assert created.status_code == 400 and created.json()["error"]["param"] == "output_expires_after", created.text


def test_a_completion_past_the_bound_of_sequences_is_refused_before_any_pod(pool: Pool) -> None:
    """The router parses with the engine's models: the engine's bound on prompts x n (MAX_SEQUENCES_PER_REQUEST) is
    its too, refused at admission, and a request at the bound is served whole."""
    prompts = MAX_SEQUENCES_PER_REQUEST // MAX_N
    body = {"prompt": [[5, 6 + i] for i in range(prompts)], "n": MAX_N, "max_tokens": 1, "temperature": 0}
    served = post_json(pool, COMPLETIONS_PATH, body)
    assert served.status_code == 200 and len(served.json()["choices"]) == MAX_SEQUENCES_PER_REQUEST, served.text
    refused = post_json(pool, COMPLETIONS_PATH, {**body, "prompt": [*body["prompt"], [7]]})
    assert refused.status_code == 400, refused.text
    assert f"{prompts + 1} prompts with n={MAX_N}" in refused.json()["error"]["message"]
    assert "x-kvmesh-pod" in served.headers and "x-kvmesh-pod" not in refused.headers  # no pod was asked


def test_paths_and_methods_nobody_serves_answer_in_openai_shape(pool: Pool) -> None:
    """FastAPI's own 404 and 405 answered {"detail": ...}, which OpenAI's clients do not read as an error."""
    missing = pool.http.get("/v1/nope", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    wrong = pool.http.get("/tokenize", headers=AUTH)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] and wrong.headers["allow"] == "POST"


def test_a_batch_creation_body_is_bounded(pool: Pool) -> None:
    """The body was read whole, however large, before anything looked at it."""
    body = {"input_file_id": pool.failing_file, "endpoint": CHAT_PATH, "padding": "x" * (1 << 20)}
    reply = post_json(pool, "/v1/batches", body)
    assert reply.status_code == 413 and "KiB" in reply.json()["error"]["message"]
    assert pool.http.post("/v1/batches", content=b"x" * (1 << 20)).status_code == 401  # no key: not even read


def test_a_batch_line_nested_past_the_bound_is_refused_with_its_line() -> None:
    """Such a line would fail to serialize when the runner sent it, as a body would on the HTTP edge."""
    deep = f'{{"custom_id": "a", "method": "POST", "url": "{CHAT_PATH}", "body": {{"x": {"[" * 300}{"]" * 300}}}}}'
    checked = check_input(deep.encode() + b"\n", CHAT_PATH, max_requests=10)
    assert [(p.code, p.line) for p in checked.problems] == [("invalid_json_line", 1)]
    assert "malformed JSON" in checked.problems[0].message


@pytest.mark.parametrize("stream", [True, False])
def test_flags_are_read_as_validated_not_as_written(pool: Pool, stream: bool) -> None:
    """"false" is False to the request types, but the router read the raw text (truthy): the client got the token
    ids and the usage chunk it had declined."""
    body = {**COMPLETION, "stream": "true" if stream else "false", "return_token_ids": "false",
            **({"stream_options": {"include_usage": "false"}} if stream else {})}  # refused without a stream
    reply = post_json(pool, COMPLETIONS_PATH, body)
    assert reply.status_code == 200, reply.text
    if stream:
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        assert chunks and not any("usage" in c for c in chunks), reply.text
        assert not any("token_ids" in choice for c in chunks for choice in c["choices"]), reply.text
    else:
        assert "token_ids" not in reply.json()["choices"][0]
    settled(pool)
