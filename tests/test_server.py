"""The engine's HTTP API over the tiny model, with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvmesh.engine.engine import LOAD_PROGRESS, Engine
from kvmesh.engine.protocol import FORECAST_LEVELS, EngineLoading, Metric, VllmMetric, read_engine_metrics
from kvmesh.engine.request import RequestOutput
from kvmesh.engine.server import EngineHolder, _chat_logprobs, _Completions, create_app
from kvmesh.operator.engines import http_scrape
from kvmesh.operator.forecast import parse_pod
from kvmesh.processes import free_port
from kvmesh.router.index import PrefixIndex
from kvmesh.router.pods import PodSet, parse_metrics
from kvmesh.router.pool_status import pod_state, pool_status
from kvmesh.status import render

from .conftest import make_engine
from .engines import serve_engine, slow_client, wait_idle


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[tuple[str, Engine]]:
    engine = make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=512)
    with serve_engine(engine) as url:
        yield url, engine
    engine.kv.check_invariants()


@pytest.fixture
def client(served: tuple[str, Engine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completion_with_openai_client(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 6
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5
    again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == text.choices[0].text
    wait_idle(served[1])


def test_a_model_is_retrieved_by_its_id(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    """OpenAI's GET /v1/models/{model}: its card of the list, or 404 model_not_found (an id may hold "/", as an
    adapter's name may)."""
    listed = client.models.list().data
    assert client.models.retrieve(listed[0].id) == listed[0]
    for unknown in ("nope", "org/nope"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        error = caught.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model" and unknown in error["message"]
    reply = httpx.get(served[0] + "/v1/models/org/nope", timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_streaming_equals_non_streaming_and_reports_usage(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "Count to five"}]}]
    whole = client.chat.completions.create(model=served[1].model_name, messages=messages, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=served[1].model_name, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens
    # the second identical request found the chat prefix cached
    assert usage.prompt_tokens_details.cached_tokens >= 16
    wait_idle(served[1])


def test_logprobs_and_n_choices(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    out = client.chat.completions.create(model=served[1].model_name, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)  # greedy = top-1
    many = client.completions.create(model=served[1].model_name, prompt="abc", max_tokens=4, n=3, seed=5,
                                     temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    ids = {"ignore_eos": True, "return_token_ids": True}
    forced = client.completions.create(model=served[1].model_name, prompt="abc", max_tokens=3, temperature=0,
                                       logit_bias={"1234": 100}, extra_body=ids)
    assert forced.choices[0].model_extra["token_ids"] == [1234, 1234, 1234]  # the bias decides every token
    wait_idle(served[1])


def test_logprobs_of_tokens_that_are_part_of_a_character(served: tuple[str, Engine]) -> None:
    """A byte token (here the first byte of "€", forced by logit_bias, and of "é") decodes alone to U+FFFD: chat's
    `bytes` are the token's own, and completions name it "bytes:\\xe2" as OpenAI's legacy API does, so two such
    alternatives never share the key U+FFFD (one hid the other, or the token's own entry a better one)."""
    url, engine = served
    e2, c3 = (engine.tokenizer._tokenizer.token_to_id(piece) for piece in ("â", "Ã"))  # byte-level pieces
    assert engine.tokenizer.decode([e2]) == engine.tokenizer.decode([c3]) == "\ufffd"
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
        "logit_bias": {str(e2): 100}}).json()["choices"][0]
    (entry,) = chat["logprobs"]["content"]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xE2]
    text = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hello", "max_tokens": 1, "logprobs": 2, "logit_bias": {str(e2): 100}}).json()
    logprobs = text["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["bytes:\\xe2"] and logprobs["text_offset"] == [0]
    assert logprobs["top_logprobs"][0]["bytes:\\xe2"] == logprobs["token_logprobs"][0]
    # alternatives the tiny model never ranks on its own: given to the formatting directly
    handler = _Completions.__new__(_Completions)
    handler.engine = engine
    out = RequestOutput("r", [e2], "\ufffd", logprobs=[-2.0], top_logprobs=[[(c3, -0.5), (e2, -2.0)]])
    (item,) = _chat_logprobs(engine, out)
    assert [(a["bytes"], a["logprob"]) for a in item["top_logprobs"]] == [([0xC3], -0.5), ([0xE2], -2.0)]
    whole, _ = handler._completion_logprobs([(e2, -2.0, [(c3, -0.5), (e2, -2.0)])])
    assert whole["top_logprobs"] == [{"bytes:\\xc3": -0.5, "bytes:\\xe2": -2.0}]
    wait_idle(engine)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "context length"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"hello": 5}}, "logit_bias keys are token ids"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias values"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}}, "outside the vocabulary"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "thing"}}}}, "invalid json_schema: Invalid type: thing"),
        # what would change the answer's kind is refused, not ignored
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "send tools and tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}, "deprecated function calling"),
        ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, "only the text modality"),
        ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy"}}, "audio output"),
    ],
)
def test_chat_validation_errors_are_400s(served: tuple[str, Engine], body: dict, fragment: str) -> None:
    reply = httpx.post(served[0] + "/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert fragment in reply.json()["error"]["message"]


def test_the_engine_tokenizes_a_salted_prompt_from_its_salt_s_pieces_only(served: tuple[str, Engine]) -> None:
    """As the prefix cache, the engine's piece cache is kept per cache_salt (the router's tenant): another salt's
    text never tokenizes faster."""
    url, engine = served
    cache = engine.tokenizer.token_cache
    assert cache is not None
    prompt = "alpha beta gamma delta " * 100  # two pieces

    def complete(salt: str) -> None:
        reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": salt})
        assert reply.status_code == 200, reply.text

    complete("tenant-a")
    hits = cache.hits
    complete("tenant-b")
    assert cache.hits == hits
    complete("tenant-a")
    assert cache.hits > hits


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_context_length_error_names_the_field_the_client_set(served: tuple[str, Engine], field: str) -> None:
    reply = httpx.post(served[0] + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], field: 100000})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    # OpenAI's code and the phrase client libraries look for to trim a conversation and try again
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 512 tokens")
    assert f"plus {field} (100000)" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_need_a_stream(served: tuple[str, Engine], path: str) -> None:
    """As OpenAI and vLLM answer it: a 400 naming stream_options, not options silently ignored."""
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    for stream in ({}, {"stream": False}):
        reply = httpx.post(served[0] + path, json={**body, **stream, "max_tokens": 1,
                                                   "stream_options": {"include_usage": True}})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "stream_options" and "stream: true" in error["message"]
    assert httpx.post(served[0] + path, json={**body, "max_tokens": 1, "stream_options": None}).status_code == 200
    streamed = httpx.post(served[0] + path, json={**body, "max_tokens": 1, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


def test_completion_errors(served: tuple[str, Engine]) -> None:
    url = served[0] + "/v1/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": [1, 2, 10**7]}).json()["error"]["message"].startswith("prompt token ids")
    too_long = httpx.post(url, json={"prompt": [5] * 600})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    unknown = httpx.post(url, json={"prompt": "x", "model": "gpt-99"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad_priority = httpx.post(url, json={"prompt": "x"}, headers={"x-kvmesh-priority": "high"})
    assert bad_priority.status_code == 400
    assert httpx.post(url, json={"prompt": []}).status_code == 400
    best_of = httpx.post(url, json={"prompt": "x", "best_of": 3, "max_tokens": 1})  # ranking candidates: not done
    assert best_of.status_code == 400 and best_of.json()["error"]["param"] == "best_of"
    same = httpx.post(url, json={"prompt": "x", "best_of": 2, "n": 2, "max_tokens": 1})  # every candidate returned
    assert same.status_code == 200 and len(same.json()["choices"]) == 2


def test_openai_client_raises_on_bad_request(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=served[1].model_name, messages=[{"role": "user", "content": "x"}],
                                       temperature=5)


def test_disconnect_mid_stream_frees_blocks(served: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    url, engine = served
    real_run = engine.runner.run
    steps = itertools.count()
    read = threading.Event()

    def held(seqs: object) -> object:
        """The tiny model would finish 400 tokens before a loaded machine's client reads its first line: steps
        after the first two wait for the client."""
        if next(steps) >= 2:
            read.wait(30)
        return real_run(seqs)

    monkeypatch.setattr(engine.runner, "run", held)
    before = _aborts(engine)
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as reply:
        # the iterator is kept: a line iterator dropped after a `break` is collected at once, and closing it
        # closes the connection, so the engine could abort the request before the check below
        lines = reply.iter_lines()
        try:
            assert next(line for line in lines if line.startswith("data:"))
            assert engine.kv.stats().used > 0
        finally:
            read.set()
    wait_idle(engine)
    assert engine.kv.stats().used == 0
    assert _aborts(engine) == before + 1


def test_kv_config_events_and_snapshot(served: tuple[str, Engine]) -> None:
    url, engine = served
    config = httpx.get(url + "/v1/kv/config").json()
    assert config["block_size"] == 16 and config["tokenizer_fingerprint"] == engine.tokenizer.fingerprint
    start = engine.events.seq
    httpx.post(url + "/v1/completions", json={"prompt": [7] * 40, "max_tokens": 2}, timeout=60)
    stored: list[int] = []
    with httpx.stream("GET", url + "/v1/kv/events", params={"after": start}, timeout=30) as reply:
        for line in reply.iter_lines():
            batch = json.loads(line)
            assert batch["boot_id"] == config["boot_id"] and batch["seq"] > start
            stored += [h for e in batch["events"] if e["type"] == "stored" for h in e["block_hashes"]]
            if len(stored) >= 2:
                break
    snapshot = httpx.get(url + "/v1/kv/blocks").json()
    assert set(stored) <= set(snapshot["blocks"]["device"])
    with httpx.stream("GET", url + "/v1/kv/events", params={"after": 0, "boot_id": "old"}, timeout=30) as reply:
        first = json.loads(next(reply.iter_lines()))
    assert first["reset"] is True and first["boot_id"] == config["boot_id"]


def test_metrics_endpoint_exports_vllm_names(served: tuple[str, Engine]) -> None:
    text = httpx.get(served[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", 'kvmesh_kv_blocks{state="evictable",tier="host"} 0.0',
                 "kvmesh_kv_forecast_usage_ratio", "kvmesh_prefill_tokens_pending"):
        assert name in text, name


def test_drain_refuses_new_requests_and_fails_health(tiny_dir: Path) -> None:
    """On its own engine: drain cannot be undone."""
    from fastapi.testclient import TestClient

    engine = make_engine(tiny_dir, kv_cache_blocks=32)
    engine.start()
    try:
        with TestClient(create_app(EngineHolder(engine))) as http:
            assert http.get("/health").status_code == 200
            assert http.post("/v1/admin/drain").json()["draining"] is True
            assert http.get("/health").status_code == 503
            refused = http.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    finally:
        engine.stop()


@pytest.mark.parametrize("part, method", [("runner", "run"), ("scheduler", "add")], ids=["step", "queuing"])
def test_a_failure_inside_the_engine_fails_its_request_not_the_server(
    served: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch, part: str, method: str
) -> None:
    """Fault injection: the model runner (a stand-in for a kernel error) or the queue (a bug in admission)
    raises once; that request gets a 500 instead of a hang, and the server keeps serving."""
    url, engine = served
    target = getattr(engine, part)
    real = getattr(target, method)
    calls = {"n": 0}

    def failing_once(arg):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(arg)

    monkeypatch.setattr(target, method, failing_once)
    failed = httpx.post(url + "/v1/completions", json={"prompt": "boom", "max_tokens": 3}, timeout=60)
    assert failed.status_code == 500 and "internal error" in failed.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    wait_idle(engine)


def _aborts(engine: Engine) -> float:
    return _finished(engine, "abort")


def _finished(engine: Engine, reason: str) -> float:
    """kvmesh_requests_total{finish_reason=reason}, as the engine's /metrics shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for s in family.samples:
            if s.name == "kvmesh_requests_total" and s.labels["finish_reason"] == reason:
                return s.value
    raise AssertionError(f"no {reason} counter")


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(
        served: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends its headers and then nothing holds the engine's connection only until
    body_read_timeout_seconds: a 408 in OpenAI's shape, counted as a request ended in error, and the connection
    closed. An answer's stream is not bounded by it, and other requests are served throughout."""
    url, engine = served
    monkeypatch.setattr(engine.config, "body_read_timeout_seconds", 0.3)
    errors = _finished(engine, "error")
    status, headers, body = slow_client(url, "/v1/completions")
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "body_timeout" and body["error"]["type"] == "invalid_request_error"
    assert "the request body did not arrive within 0.3 s" in body["error"]["message"]
    assert _finished(engine, "error") == errors + 1
    status, _, body = slow_client(url, "/v1/load_lora_adapter", b'{"lora_name"')  # another route: bounded too
    assert status == 408 and _finished(engine, "error") == errors + 1  # not a completion: counted in no series
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 60, "ignore_eos": True,
                                                             "stream": True}, timeout=30) as reply:
        chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert reply.status_code == 200 and len(chunks) == 60  # 0.6 s or more of stream, past the deadline, whole
    wait_idle(engine)


def test_disconnect_during_a_non_streaming_request_aborts_it(served: tuple[str, Engine],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url, engine = served
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    before = _aborts(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
    wait_idle(engine)
    assert _aborts(engine) == before + 1


def test_usage_counts_the_prompt_once_for_n_choices(served: tuple[str, Engine]) -> None:
    url = served[0]
    one = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 2, "ignore_eos": True})
    two = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 2, "n": 3,
                                                    "ignore_eos": True})
    assert two.json()["usage"]["prompt_tokens"] == one.json()["usage"]["prompt_tokens"]
    assert two.json()["usage"]["completion_tokens"] == 6


def test_completions_default_to_16_tokens_and_tiny_temperature_is_greedy(served: tuple[str, Engine]) -> None:
    url = served[0]
    default = httpx.post(url + "/v1/completions", json={"prompt": "a b c", "ignore_eos": True}).json()
    assert default["usage"]["completion_tokens"] == 16
    greedy = httpx.post(url + "/v1/completions", json={"prompt": "a b c", "temperature": 0, "max_tokens": 5,
                                                       "ignore_eos": True}).json()
    tiny = httpx.post(url + "/v1/completions", json={"prompt": "a b c", "temperature": 1e-40, "max_tokens": 5,
                                                     "ignore_eos": True}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"] != ""


def test_the_router_and_operator_read_what_the_engine_exports(served: tuple[str, Engine]) -> None:
    """Contract 3 end to end: the one reader of an engine's /metrics (engine/protocol.py) and the router's and
    operator's views of it agree with the engine's own state."""
    url, engine = served
    text = httpx.get(url + "/metrics").text
    read = read_engine_metrics(text)
    assert (read.num_blocks, read.block_size) == (engine.kv.pool.num_blocks, engine.kv.block_size)
    assert set(read.forecast_usage) == set(FORECAST_LEVELS)
    picker, _ = parse_metrics(text)
    assert picker["running"] == picker["waiting"] == 0 and picker["num_blocks"] == engine.kv.pool.num_blocks
    assert picker["forecast_usage_p90"] == read.forecast_usage["p90"]
    pod = parse_pod("p", "both", text)
    assert pod.block_size == engine.kv.block_size and pod.observation.num_blocks == engine.kv.pool.num_blocks
    assert pod.counters.prompt_tokens == read.values[f"{VllmMetric.PROMPT_TOKENS}_total"]


def test_a_broken_gauge_is_read_as_absent_not_as_a_number() -> None:
    """NaN or infinity from one engine must not reach the operator's arithmetic: the pool's scaling would stop."""
    text = ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} NaN\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} +Inf\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 3\n'
            '# TYPE kvmesh_kv_forecast_usage_ratio gauge\nkvmesh_kv_forecast_usage_ratio{level="p90"} NaN\n')
    read = read_engine_metrics(text)
    assert read.values == {VllmMetric.WAITING: 3.0} and read.forecast_usage == {}
    pod = parse_pod("p", "both", text)
    assert (pod.observation.running, pod.observation.waiting, pod.observation.usage) == (0, 3, 0.0)


def test_a_loading_engine_says_so_on_metrics_and_serves_nothing_else(tiny_dir: Path) -> None:
    """While its model loads, /metrics answers 200 with kvmesh_engine_loading 1 and the process's metrics
    (Prometheus sees a starting pod, not a down one) and every other route 503; the router sees a loading pod, not
    a candidate, and its and the operator's scrapes leave it out rather than read a serving pod with nothing
    running; `kvmesh status` shows how far its load is. Loaded, the gauge reads 0 and the pod serves."""
    release, reported = threading.Event(), threading.Event()
    engine = make_engine(tiny_dir, kv_cache_blocks=32)

    def held_load() -> Engine:
        LOAD_PROGRESS.get()(0.25)  # a quarter of its weights read
        reported.set()
        release.wait()
        return engine

    holder = EngineHolder(loader=held_load)
    loading = holder.load_in_background()
    assert reported.wait(30)  # the loading thread may start after the first scrape on a loaded machine
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(holder), host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{port}"
    try:
        metrics = _answered(url + "/metrics")
        assert metrics.status_code == 200
        assert read_engine_metrics(metrics.text).values[Metric.ENGINE_LOADING] == 1
        assert "process_resident_memory_bytes" in metrics.text
        health = httpx.get(url + "/health")
        assert (health.status_code, health.json()["status"]) == (503, "loading")
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "not_ready")
        with pytest.raises(EngineLoading):
            parse_metrics(metrics.text)
        with pytest.raises(EngineLoading):
            http_scrape(url + "/metrics")

        async def routed() -> None:
            pods = PodSet([url], engine.kv_config, PrefixIndex(), scrape_interval=0.05, stale_after=5.0)
            await pods.start()
            try:
                await _eventually(lambda: pods.pods[url].loading)
                assert pod_state(pods.pods[url]) == "loading" and not pods.snapshot()[0].healthy
                assert pods.pods[url].load_progress == 0.25
                doc = pool_status(pods.pods, pods.snapshot(), pods.index, time.monotonic())
                assert doc["pods"][0]["load_progress"] == 0.25
                assert "loading 25%" in render(doc) and "1 starting" in render(doc)
                release.set()
                await asyncio.to_thread(loading.join)
                await _eventually(lambda: pods.snapshot()[0].healthy)
                assert pod_state(pods.pods[url]) == "healthy" and pods.pods[url].load_progress is None
            finally:
                await pods.stop()

        asyncio.run(asyncio.wait_for(routed(), 60))
        text = http_scrape(url + "/metrics")
        assert read_engine_metrics(text).values[Metric.ENGINE_LOADING] == 0
        assert "process_resident_memory_bytes" in text and parse_metrics(text)[0]["running"] == 0
    finally:
        release.set()
        loading.join(timeout=60)  # the engine started, however the test went: stopped here
        server.should_exit = True
        serving.join(timeout=10)
        engine.stop()


def test_metrics_show_how_far_a_load_is(tiny_dir: Path) -> None:
    """While the model loads, /metrics shows the share of its weights read so far, from the real load of the tiny
    model (held after its first report that passes a half); once loaded, 1."""
    from fastapi.testclient import TestClient

    held, release = threading.Event(), threading.Event()
    held_at: list[float] = []

    def held_load() -> Engine:
        report = LOAD_PROGRESS.get()  # the holder's gauge

        def hold(ratio: float) -> None:
            report(ratio)
            if ratio >= 0.5 and not held_at:
                held_at.append(ratio)
                held.set()
                release.wait()

        LOAD_PROGRESS.set(hold)
        return make_engine(tiny_dir, kv_cache_blocks=32)

    holder = EngineHolder(loader=held_load)
    loading = holder.load_in_background()
    try:
        with TestClient(create_app(holder)) as http:
            assert held.wait(120), holder.error  # a load that failed before half: its error, not a hang
            values = read_engine_metrics(http.get("/metrics").text).values
            assert values[Metric.ENGINE_LOADING] == 1 and 0 < values[Metric.ENGINE_LOAD_PROGRESS] < 1
            assert values[Metric.ENGINE_LOAD_PROGRESS] == held_at[0]
            release.set()
            loading.join()
            values = read_engine_metrics(http.get("/metrics").text).values
            assert (values[Metric.ENGINE_LOADING], values[Metric.ENGINE_LOAD_PROGRESS]) == (0, 1)
    finally:
        release.set()
        loading.join(timeout=60)
        if holder.engine is not None:
            holder.engine.stop()


def test_a_failed_load_answers_metrics_503() -> None:
    """An engine whose load failed will not serve: its target is down (KvmeshEngineDown), not loading for ever."""
    from fastapi.testclient import TestClient

    def broken_load() -> Engine:
        raise OSError("no such model")

    holder = EngineHolder(loader=broken_load)
    holder.load_in_background().join()
    with TestClient(create_app(holder)) as http:
        assert http.get("/metrics").status_code == 503
        assert http.get("/health").json() == {"status": "error", "error": "OSError: no such model"}


def _answered(url: str) -> httpx.Response:
    """GET `url` once the server listens (it starts in a thread)."""
    for _ in range(300):
        try:
            return httpx.get(url)
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


async def _eventually(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.02)


def test_null_for_an_optional_field_means_its_default(client: openai.OpenAI) -> None:
    """The official client sends null for an argument given as None (`temperature=None`), as do wrappers that
    serialize unset fields: OpenAI and vLLM read it as the default; it was a 400."""
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=None, top_p=None, n=None, presence_penalty=None,
                                          frequency_penalty=None, logprobs=None, parallel_tool_calls=None,
                                          stream=None)
    assert len(chat.choices) == 1 and chat.usage.completion_tokens <= 3
    text = client.completions.create(model=model, prompt="Hi", max_tokens=2, echo=None, n=None, temperature=None)
    assert len(text.choices) == 1


def test_a_json_body_without_a_content_type_is_read_as_json(served: tuple[str, Engine]) -> None:
    """requests.post(url, data=json.dumps(body)) sends no Content-Type: read as JSON, as the router reads it."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    reply = httpx.post(served[0] + "/v1/completions", content=body, headers={"content-type": ""}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] <= 2


def test_a_streamed_completion_s_text_offsets_go_on_from_chunk_to_chunk(served: tuple[str, Engine]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = httpx.post(served[0] + "/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    offsets = []
    with httpx.stream("POST", served[0] + "/v1/completions", json={**body, "stream": True}, timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                offsets += json.loads(line[6:])["choices"][0]["logprobs"]["text_offset"]
    assert offsets == whole["text_offset"] and len(set(offsets)) > 1


@pytest.mark.parametrize(("extra", "param"), [({"repetition_penalty": 0}, "repetition_penalty"),
                                              ({"repetition_penalty": 10.5}, "repetition_penalty"),
                                              ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                                              ({"chat_template_kwargs": {"add_generation_prompt": False}},
                                               "chat_template_kwargs")])
def test_vllm_s_repetition_penalty_and_template_variables_are_taken_within_their_bounds(
        served: tuple[str, Engine], extra: dict, param: str) -> None:
    """Out of range, or a template variable the request's own fields give (the messages), is a 400 naming the
    field; within range both are taken (the tokenizer and engine tests show what they do)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    refused = httpx.post(served[0] + "/v1/chat/completions", json={**body, **extra}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    taken = {**body, "repetition_penalty": 1.3, "chat_template_kwargs": {"enable_thinking": False}, "min_p": 0.1}
    assert httpx.post(served[0] + "/v1/chat/completions", json=taken, timeout=30).status_code == 200


def test_echo_with_logprobs_scores_a_prompt_as_lm_eval_asks(client: openai.OpenAI, served: tuple[str, Engine]) -> None:
    """lm-eval's loglikelihood requests: token-id prompts, several at once, `echo` with `logprobs: 1` and
    max_tokens 1 (or 0 in older harnesses). The choice's text starts with the prompt; its logprobs cover the prompt
    tokens (the first has none) and then the generated ones, with text offsets running on; the prompt's logprobs
    are the model's, the same whether or not a token is generated and whether or not the answer streams."""
    model, tok = served[1].model_name, served[1].tokenizer
    context, continuation = tok.encode("The capital of France is"), tok.encode(" Paris")
    asked = client.completions.create(model=model, prompt=[context + continuation, context], max_tokens=1, echo=True,
                                      logprobs=1, temperature=0)
    first, second = sorted(asked.choices, key=lambda c: c.index)
    lp = first.logprobs
    assert first.text.startswith(tok.decode(context + continuation))
    assert len(lp.tokens) == len(context) + len(continuation) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    # each token among its alternatives (vLLM's and OpenAI's shape: the top 1 plus the token, one entry when equal)
    assert all(top[token] == x and 1 <= len(top) <= 2 and x <= max(top.values())
               for token, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert second.logprobs.token_logprobs[: len(context)] == pytest.approx(lp.token_logprobs[: len(context)],
                                                                            abs=1e-4)
    only = httpx.post(served[0] + "/v1/completions", timeout=30, json={
        "model": model, "prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    [choice] = only["choices"]
    assert choice["text"] == tok.decode(context + continuation) and choice["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lp.token_logprobs[:-1], abs=1e-4)
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, echo=True,
                                            logprobs=0, temperature=0, stream=True))
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, echo=True, logprobs=0,
                                      temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [x for c in chunks for x in c.choices[0].logprobs.text_offset] == whole.choices[0].logprobs.text_offset
    assert all(top == {token: x} for token, x, top in zip(whole.choices[0].logprobs.tokens[1:],
                                                          whole.choices[0].logprobs.token_logprobs[1:],
                                                          whole.choices[0].logprobs.top_logprobs[1:], strict=True))
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text == whole.choices[0].text and plain.choices[0].logprobs is None
    prompt_only = client.completions.create(model=model, prompt="Once upon a time", max_tokens=0, echo=True)
    assert prompt_only.choices[0].text == "Once upon a time" and prompt_only.usage.completion_tokens == 0
    wait_idle(served[1])


@pytest.mark.parametrize(("body", "param"), [({"max_tokens": 0}, "max_tokens"), ({"suffix": "end"}, "suffix"),
                                             ({"echo": True, "resume_output_ids": [5]}, "echo")])
def test_what_echo_and_max_tokens_0_do_not_cover_is_refused(served: tuple[str, Engine], body: dict,
                                                            param: str) -> None:
    reply = httpx.post(served[0] + "/v1/completions", json={"prompt": "Hi", **body}, timeout=30)
    assert reply.status_code == 400 and param in json.dumps(reply.json()["error"])
