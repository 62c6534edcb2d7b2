"""A disaggregated pool: one prefill and one decode engine process behind the router (the tiny model)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig
from kvmesh.router.proxy import UpstreamError

from .engines import serve_router, tiny_engines
from .test_router_disconnect import wait_nothing_in_flight

pytestmark = pytest.mark.slow

Served = tuple[dict[str, str], Router, dict[str, subprocess.Popen[bytes]]]


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The URLs of the prefill pod, the decode pod and the router; the Router; the engines' processes by URL."""
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("disagg"), ("prefill", "decode")) as procs:
        prefill, decode = procs
        router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1, prefill_hop_min_tokens=32),
                              tiny_dir)
        with serve_router(router) as url:
            for _ in range(100):  # the router knows both roles
                if len(httpx.get(url + "/health").json()["pods"]) == 2:
                    break
                threading.Event().wait(0.1)
            yield {"prefill": prefill, "decode": decode, "router": url}, router, procs


@pytest.fixture(scope="module")
def pool(served: Served) -> dict[str, str]:
    return served[0]


@pytest.fixture(scope="module")
def router(served: Served) -> Router:
    return served[1]


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_disaggregated_equals_aggregated(pool: dict[str, str], router: Router, sampling: dict) -> None:
    prompt = tokens(5 + len(sampling), 90)
    body = {"prompt": prompt, "max_tokens": 12, "return_token_ids": True, **sampling}
    split = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    assert split.status_code == 200, split.text
    assert split.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
    whole = httpx.post(pool["decode"] + "/v1/completions", json=body, timeout=60).json()
    assert split.json()["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    assert split.json()["choices"][0]["text"] == whole["choices"][0]["text"]
    usage = split.json()["usage"]
    assert usage["prompt_tokens"] == 90 and usage["completion_tokens"] == 12
    wait_nothing_in_flight(router)  # the prefill pod's part ended with its answer, the decode pod's with the reply


def test_disaggregated_streaming_chat(pool: dict[str, str], router: Router) -> None:
    messages = [{"role": "user", "content": "Write a long story about a cat and a dog. " * 4}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(pool["prefill"] + "/v1/chat/completions", json=body, timeout=60).json()
    text, roles, ids = "", 0, set()
    with httpx.stream("POST", pool["router"] + "/v1/chat/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.headers["x-kvmesh-pod"].startswith(pool["prefill"])
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    for chunk in chunks:
        ids.add(chunk["id"])
        for choice in chunk["choices"]:
            assert "token_ids" not in choice  # the router asked for them, the client did not
            text += choice["delta"].get("content") or ""
            roles += "role" in choice["delta"]
    assert text == whole["choices"][0]["message"]["content"]
    assert roles == 1 and len(ids) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)  # the key on every chunk, as OpenAI's
    wait_nothing_in_flight(router)


def test_a_short_uncached_prompt_skips_the_prefill_hop(pool: dict[str, str]) -> None:
    reply = httpx.post(pool["router"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == pool["decode"]


def test_a_prefill_that_ends_the_request_as_it_arrives_is_the_answer(pool: dict[str, str], router: Router) -> None:
    """A constraint complete before any token (the only choice is empty): the prefill pod answers with no token
    and no handle; that answer is the client's, not a 500."""
    body = {"prompt": tokens(40, 90), "max_tokens": 8, "structured_outputs": {"choice": [""]}}
    reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "" and reply.json()["choices"][0]["finish_reason"] == "stop"
    assert reply.headers["x-kvmesh-pod"] == pool["prefill"]
    wait_nothing_in_flight(router)


def test_a_tool_call_is_answered_whole_by_one_pod(pool: dict[str, str], router: Router) -> None:
    """A pod parses tool calls out of all the text it generated: the router sends a tool request whole to one pod
    rather than splitting it between a prefill and a decode pod, each of which would see part of the text."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris? " * 8}], "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 40, "seed": 1}
    reply = httpx.post(pool["router"] + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == pool["decode"]
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    wait_nothing_in_flight(router)


@pytest.mark.parametrize("include", [False, True], ids=["stop-dropped", "include_stop_str_in_output"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_that_begins_in_the_prefill_pod_s_token_ends_the_split_answer_as_one_pod(
        pool: dict[str, str], router: Router, stream: bool, include: bool) -> None:
    """The prefill pod's first token may end with the start of a stop string the decode pod's next token
    completes: the router sends that token's text without the tail (the decode pod sends it, or drops it when the
    stop string completes), so the client reads what one pod alone sends, not the stop string's first part. With
    include_stop_str_in_output nothing is held back, by the router as by the decode pod."""
    body = {"prompt": tokens(43, 90), "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "include_stop_str_in_output": include}
    free = httpx.post(pool["decode"] + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    first, second = (httpx.post(pool["decode"] + "/detokenize", json={"tokens": [t]}, timeout=10).json()["prompt"]
                     for t in free["token_ids"][:2])
    assert free["text"].startswith(first + second) and first and second
    body["stop"] = [first[-1] + second[0]]
    assert free["text"].find(body["stop"][0]) == len(first) - 1
    alone = httpx.post(pool["decode"] + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert alone["text"] == (first + second[0] if include else first[:-1]) and alone["finish_reason"] == "stop"
    body["cache_salt"] = f"split-{stream}-{include}"  # the decode pod cached the prompt: none
    if not stream:
        reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
        assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
        assert reply.json()["choices"][0]["text"] == alone["text"]
    else:
        with httpx.stream("POST", pool["router"] + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as reply:
            assert reply.headers["x-kvmesh-pod"].startswith(pool["prefill"])
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone["text"]
    wait_nothing_in_flight(router)


def test_a_first_token_that_is_half_a_character_is_sent_once(pool: dict[str, str], router: Router) -> None:
    """Token 142 is the byte 0xC3, the first half of a two-byte character: the prefill pod, whose output ends at its
    forced single token, leaves it to the decode pod (which holds it back until the character completes, or sends
    the replacement character when it cannot) instead of flushing a replacement character the decode pod then
    sends again."""
    body = {"prompt": tokens(44, 90), "max_tokens": 3, "temperature": 0, "logit_bias": {"142": 100},
            "cache_salt": "half-character"}
    alone = httpx.post(pool["decode"] + "/v1/completions", json={**body, "cache_salt": "alone"}, timeout=60).json()
    reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
    assert reply.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    wait_nothing_in_flight(router)


@pytest.mark.parametrize("chat", [False, True])
def test_a_split_answer_s_logprobs_begin_with_the_prefill_pod_s_token(pool: dict[str, str], router: Router,
                                                                      chat: bool) -> None:
    """The first token comes from the prefill pod: its logprobs lead the answer's, streamed or not, and a
    completion's text offsets run on from it, as one pod's answer has them."""
    if chat:
        body = {"messages": [{"role": "user", "content": "A long tale of a fox. " * 12}], "logprobs": True,
                "top_logprobs": 1}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": tokens(45, 90), "logprobs": 1}
        path = "/v1/completions"
    body |= {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(pool["decode"] + path, json={**body, "cache_salt": "alone"}, timeout=60).json()
    expected = alone["choices"][0]["logprobs"]
    split = httpx.post(pool["router"] + path, json={**body, "cache_salt": "split"}, timeout=60)
    assert split.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
    with httpx.stream("POST", pool["router"] + path, timeout=60,
                      json={**body, "cache_salt": "streamed", "stream": True}) as reply:
        assert reply.headers["x-kvmesh-pod"].startswith(pool["prefill"])
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    for got in (split.json()["choices"][0]["logprobs"],
                {"content": [x for lp in streamed for x in lp["content"]]} if chat else
                {k: [x for lp in streamed for x in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}):
        if chat:
            assert [x["token"] for x in got["content"]] == [x["token"] for x in expected["content"]]
            assert [x["logprob"] for x in got["content"]] == pytest.approx(
                [x["logprob"] for x in expected["content"]], abs=1e-4)
        else:
            assert got["tokens"] == expected["tokens"] and got["text_offset"] == expected["text_offset"]
            assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-4)
    wait_nothing_in_flight(router)


@pytest.mark.parametrize("chat", [False, True])
def test_a_split_stream_s_chunks_share_one_model_and_created(pool: dict[str, str], router: Router,
                                                             chat: bool) -> None:
    """The router builds the first chunk from the prefill pod's token: it carries that answer's model and created,
    as the decode pod's chunks then do, so a client accumulating the stream (the openai client's) reads one model
    (it read None) and one creation time (the router's clock, which could be a second off)."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "A tale of an owl. " * 12}]})
                  if chat else ("/v1/completions", {"prompt": tokens(46, 90)}))
    body |= {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True, "cache_salt": "one-model"}
    with httpx.stream("POST", pool["router"] + path, json=body, timeout=60) as reply:
        assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 4
    model = httpx.get(pool["decode"] + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert {(chunk.get("model"), chunk["created"]) for chunk in chunks} == {(model, chunks[-1]["created"])}
    wait_nothing_in_flight(router)


def test_an_echo_is_answered_whole_by_one_pod(pool: dict[str, str], router: Router) -> None:
    """An echo with logprobs (an evaluation harness scoring a prompt) reads the prompt's logprobs on the pod that
    computes the prompt: the router sends it whole to a decode pod, never split (the engine refuses echo with a
    KV handoff), and the answer is the one that pod gives alone."""
    body = {"prompt": tokens(41, 90), "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == pool["decode"]
    alone = httpx.post(pool["decode"] + "/v1/completions", json=body, timeout=60).json()
    got, expected = reply.json()["choices"][0], alone["choices"][0]
    assert got["text"] == expected["text"] and len(got["logprobs"]["tokens"]) == 91
    assert got["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
    wait_nothing_in_flight(router)


def test_an_overloaded_pool_sheds_a_request_that_would_be_split(pool: dict[str, str], router: Router) -> None:
    """Shedding (and so fair sharing) is decided before the prefill hop: a long uncached prompt is refused with
    429 like any other when no pod can meet the TTFT objective; it used to go to the prefill pod regardless."""
    kept = router.shed
    router.shed = dataclasses.replace(kept, ttft_slo_seconds=1e-6, priority_headroom=0.0)
    try:
        reply = httpx.post(pool["router"] + "/v1/completions", json={"prompt": tokens(60, 90), "max_tokens": 2},
                           timeout=60)
    finally:
        router.shed = kept
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "overloaded", reply.text
    assert "retry-after" in reply.headers
    wait_nothing_in_flight(router)


def prompt_tokens_computed(url: str) -> float:
    (line,) = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("vllm:prompt_tokens_total")]
    return float(line.split()[-1])


def test_with_no_decode_pod_up_nothing_is_prefilled(served: Served) -> None:
    """A decode rollout or crash loop: every request got its 503 only after the prefill pod had computed its
    prompt and pinned its KV for the handoff's 30 s, until the pinned KV filled the pod and requests waited 30 s
    for their 503. The router now skips the hop when no pod could continue."""
    pool, router, procs = served
    decode = procs[pool["decode"]]
    before = prompt_tokens_computed(pool["prefill"])
    decode.send_signal(signal.SIGSTOP)  # silent: the router's health checks find no answer
    try:
        for _ in range(300):
            if not router.pods.pods[pool["decode"]].healthy:
                break
            threading.Event().wait(0.1)
        reply = httpx.post(pool["router"] + "/v1/completions", json={"prompt": tokens(70, 90), "max_tokens": 4},
                           timeout=60)
    finally:
        decode.send_signal(signal.SIGCONT)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_pod", reply.text
    assert prompt_tokens_computed(pool["prefill"]) == before
    for _ in range(300):  # healthy again for the module's other tests
        if router.pods.pods[pool["decode"]].healthy:
            break
        threading.Event().wait(0.1)
    wait_nothing_in_flight(router)


def blocks_pinned(url: str) -> float:
    (line,) = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("kvmesh_kv_blocks_pinned{")]
    return float(line.split()[-1])


def test_a_handoff_no_decode_pod_takes_is_released_at_once(served: Served,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode pod fails before its first byte (as a pod that breaks off a connection): no pod is left, and the
    prefill pod's handle, pinned for 30 s before, is released with the 503. The router's posts of decode steps are
    made to fail here: no real pod can be made to refuse only those."""
    pool, router, _ = served
    post = router.upstream.post

    async def refusing_decode(url: str, body: Any, *args: Any, **kwargs: Any) -> Any:
        if (body.get("kv_transfer") or {}).get("mode") == "decode":
            raise UpstreamError("the decode pod broke off the connection")
        return await post(url, body, *args, **kwargs)

    monkeypatch.setattr(router.upstream, "post", refusing_decode)
    reply = httpx.post(pool["router"] + "/v1/completions", json={"prompt": tokens(80, 90), "max_tokens": 4},
                       timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_pod", reply.text
    assert_unpinned_soon(pool["prefill"])
    monkeypatch.undo()
    wait_nothing_in_flight(router)


def assert_unpinned_soon(prefill: str) -> None:
    """The prefill pod pins no block within 10 s, well before a handle's 30 s TTL would free them."""
    for _ in range(100):
        if blocks_pinned(prefill) == 0:
            break
        threading.Event().wait(0.1)
    assert blocks_pinned(prefill) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_the_decode_hop_releases_the_handoff(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                                  stream: bool) -> None:
    """The client leaves after the prefill pod answered, while the decode step is still opening (the decode pod
    pulling the KV): the prefill pod's handle is released then; its blocks stayed pinned for nobody until the
    handle's 30 s TTL. The router's post of the decode step is held here, as a slow pull holds it."""
    pool, router, _ = served
    post = router.upstream.post
    reached = threading.Event()

    async def held_decode(url: str, body: Any, *args: Any, **kwargs: Any) -> Any:
        if (body.get("kv_transfer") or {}).get("mode") == "decode":
            reached.set()
            await asyncio.sleep(60)  # cancelled when the client leaves
        return await post(url, body, *args, **kwargs)

    monkeypatch.setattr(router.upstream, "post", held_decode)
    payload = json.dumps({"prompt": tokens(90 + stream, 90), "max_tokens": 4, "stream": stream}).encode()
    address = urlsplit(pool["router"])
    with socket.create_connection((address.hostname, address.port), timeout=60) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        assert reached.wait(60)
        assert blocks_pinned(pool["prefill"]) > 0  # the handoff's KV, pinned for the decode pod
    assert_unpinned_soon(pool["prefill"])  # the client has gone
    monkeypatch.undo()
    wait_nothing_in_flight(router)


def test_a_one_token_answer_pins_nothing_on_the_prefill_pod(pool: dict[str, str], router: Router) -> None:
    """A request for one token is answered by the prefill pod alone: it is sent there as a plain request, so the
    pod keeps no KV under a handle for a decode step that will not come (it did, for the handle's 30 s)."""
    reply = httpx.post(pool["router"] + "/v1/completions",
                       json={"prompt": tokens(95, 90), "max_tokens": 1, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == pool["prefill"]
    assert reply.json()["usage"]["completion_tokens"] == 1
    assert_unpinned_soon(pool["prefill"])
    wait_nothing_in_flight(router)


def test_a_stop_at_the_first_token_releases_the_handoff(pool: dict[str, str], router: Router) -> None:
    """The prefill pod's first token completes a stop string: the prefill pod's answer is the whole answer, and
    the KV it kept for the decode pod is released at once instead of at the handle's 30 s TTL."""
    prompt = tokens(96, 90)  # a seed no other test of the module sends (its prefix would be pulled, not split)
    first = httpx.post(pool["router"] + "/v1/completions",  # answered by the prefill pod alone (above)
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=60).json()
    stop = first["choices"][0]["text"]
    assert stop.strip(), "the tiny model's first token here must have text to stop on"
    reply = httpx.post(pool["router"] + "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [stop]}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == pool["prefill"]
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    assert_unpinned_soon(pool["prefill"])
    wait_nothing_in_flight(router)
