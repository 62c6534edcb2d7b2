"""Pods that misbehave at the edges of the protocol, as loopback stub pods (kvmesh bench router's stub, which answers
the scrape as an engine does), with fault injection where a real engine cannot be made to fail that way: one that
breaks off a non-streamed answer after its headers is a 502 with a message, counted and logged as an error, its
in-flight count given back; one without /v1/models (an engine of another make) serves the model its KV config
names; a stream of several choices cut after only some finished ends with an error event, not a [DONE] that reads
as whole; a disaggregated request whose prefill pod breaks off, or whose decode pod answers no JSON, is served
whole or answered with a message (never a bare 500); a long non-streamed answer past the read timeout is a 504
from one pod, not a run on every pod; a streaming client that leaves during the prefill hop starts no decode; a
stream whose pod goes silent and fails its health checks moves to another pod within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvmesh.bench.router import _stub_routes
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.protocol import KV_TRANSFER_FIELD, MODELS_PATH
from kvmesh.processes import free_port
from kvmesh.router import pods as pods_module
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router

# A stub's answer to a completion POST: (its parsed body, the connection's writer) -> keep the connection open
Answer = Callable[[dict, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Stub:
    url: str
    bodies: list[dict]  # the completion requests it received, in order
    healthy: bool = True  # False: it drops every health check's connection (its host is gone)


@contextmanager
def stub_pod(tiny_dir: Path, breaks: bool = False, models: bool = True, answer: Answer | None = None,
             role: str = "both") -> Iterator[Stub]:
    """A stub pod; with `breaks` its completions promise their whole length and send half of it, then close; without
    `models` it has no /v1/models; `answer` answers its completion POSTs instead of the stub's fixed answer."""
    routes = _stub_routes(Tokenizer.from_dir(tiny_dir).fingerprint, role)
    if not models:
        del routes[MODELS_PATH.encode()]
    port = free_port()
    loop = asyncio.new_event_loop()
    stub = Stub(f"http://127.0.0.1:{port}", [])
    writers: set[asyncio.StreamWriter] = set()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1].split(b"?", 1)[0]
                length = next((int(line[15:]) for line in lines[1:] if line[:15].lower() == b"content-length:"), 0)
                body = await reader.readexactly(length) if length else b""
                if target == b"/health" and not stub.healthy:
                    return
                if target.endswith(b"/completions"):
                    stub.bodies.append(json.loads(body))
                    if answer is not None:
                        if await answer(stub.bodies[-1], writer):
                            continue
                        return
                status, kind, out = routes.get(target, (404, b"application/json", b"{}"))
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, kind,
                                                                                                 len(out)))
                if breaks and target == b"/v1/completions":
                    writer.write(out[: len(out) // 2])
                    await writer.drain()
                    return  # the connection closes mid-body
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writers.discard(writer)
            writer.close()

    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(connection, "127.0.0.1", port))
        started.set()
        loop.run_forever()
        server.close()
        for writer in writers:  # connections still open (a stream cut short): closed while the loop still runs
            writer.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    yield stub
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@contextmanager
def routed(tiny_dir: Path, pods: list[str], **config: object) -> Iterator[tuple[str, Router]]:
    """A router in front of `pods`, once it routes to all of them."""
    router = build_router(RouterConfig(pods=pods, scrape_interval_seconds=0.1, **config), tiny_dir)  # type: ignore[arg-type]
    with serve_router(router) as url:
        for _ in range(100):
            if len(httpx.get(url + "/health").json()["pods"]) == len(pods) and all(
                    p.kv_config is not None for p in router.pods.pods.values()):
                break
            threading.Event().wait(0.1)
        yield url, router


def outcomes(router: Router) -> dict[tuple[str, ...], float]:
    """kvmesh_router_requests_total's samples that counted something, by (outcome, route, source)."""
    family = router.metrics.requests.collect()[0]
    return {tuple(s.labels.values()): s.value for s in family.samples if s.name.endswith("_total") and s.value}


def counted(router: Router, expected: dict[tuple[str, ...], float]) -> None:
    """Wait (a bounded poll) until the router's request counts are `expected`: a relayed stream is counted as its
    response closes, a moment after the client read its end."""
    for _ in range(200):
        if outcomes(router) == expected:
            return
        time.sleep(0.025)
    assert outcomes(router) == expected


def ask(pod: str, tiny_dir: Path) -> tuple[httpx.Response, Router]:
    """One completion through a router in front of `pod` alone, once the router routes to it."""
    with routed(tiny_dir, [pod]) as (url, router):
        return httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=30), router


def test_a_pod_that_breaks_off_its_answer_is_a_502_counted_and_logged(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir, breaks=True) as pod:
        reply, router = ask(pod.url, tiny_dir)
    assert reply.status_code == 502, reply.text
    assert "broke off its answer" in reply.json()["error"]["message"]
    assert router.metrics.requests.labels("error", "aggregated", "client")._value.get() == 1
    assert all(p.inflight == 0 for p in router.pods.pods.values())


def test_a_pod_without_a_model_list_serves_the_model_its_kv_config_names(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir, models=False) as pod:
        reply, router = ask(pod.url, tiny_dir)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == " Paris"
    (served,) = [p.served for p in router.pods.pods.values()]
    assert served is not None and served.names == {"stub"}


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LONG_PROMPT = list(range(1000, 1300))  # 300 tokens: past prefill_hop_min_tokens, so it takes the prefill hop


def sse(event: dict | str) -> bytes:
    """One server-sent event as an HTTP chunk."""
    data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


def text_chunk(index: int, text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def json_reply(body: dict, status: int = 200) -> bytes:
    data = json.dumps(body).encode()
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data),
                                                                                                   data)


def prefill_answer(body: dict) -> dict:
    """What a prefill pod answers: the first token, and the handle of the KV it keeps for the decode pod."""
    return {"id": "cmpl-p", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "text": " x", "logprobs": None, "finish_reason": "length", "token_ids": [5]}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                      "total_tokens": len(body["prompt"]) + 1, "prompt_tokens_details": {"cached_tokens": 0}},
            KV_TRANSFER_FIELD: {"handle": "h", "expires_at": 0, "num_blocks": 18}}


def stream_lines(url: str, body: dict, timeout: float = 30) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as reply:
        assert reply.status_code == 200
        return [line for line in reply.iter_lines() if line]


def test_a_stream_of_two_choices_cut_after_one_finished_ends_with_an_error_not_done(tiny_dir: Path) -> None:
    """n=2: choice 0 finished, choice 1 had not when the pod's connection closed. The client must read an error
    (such a stream cannot move to another pod), not a [DONE] that passes the half answer off as whole."""
    async def one_choice_finishes_then_the_pod_dies(body: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD + sse(text_chunk(0, " a")) + sse(text_chunk(1, " b")) + sse(text_chunk(0, " c", "stop"))
                     + sse(text_chunk(1, " d")))
        await writer.drain()
        return False  # closed without the last chunk

    with stub_pod(tiny_dir, answer=one_choice_finishes_then_the_pod_dies) as pod, routed(tiny_dir, [pod.url]) as (
            url, router):
        lines = stream_lines(url, {"prompt": "Hi", "max_tokens": 5, "n": 2, "stream": True})
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2].removeprefix("data: ")), lines
        counted(router, {("error", "aggregated", "client"): 1})


def test_a_stream_the_pod_ends_with_its_own_error_event_is_counted_as_an_error(tiny_dir: Path) -> None:
    async def fails_mid_stream(body: dict, writer: asyncio.StreamWriter) -> bool:
        error = {"error": {"message": "internal error while computing this request", "type": "server_error"}}
        writer.write(SSE_HEAD + sse(text_chunk(0, " a")) + sse(error) + sse("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        return True

    with stub_pod(tiny_dir, answer=fails_mid_stream) as pod, routed(tiny_dir, [pod.url]) as (url, router):
        lines = stream_lines(url, {"prompt": "Hi", "max_tokens": 5, "stream": True})
        assert "internal error" in lines[-2] and lines[-1] == "data: [DONE]"
        counted(router, {("error", "aggregated", "client"): 1})


def test_a_prefill_pod_that_breaks_off_its_answer_leaves_the_request_to_a_decode_pod_whole(tiny_dir: Path) -> None:
    async def breaks_off(body: dict, writer: asyncio.StreamWriter) -> bool:
        whole = json_reply(prefill_answer(body))
        writer.write(whole[: len(whole) - 40])
        await writer.drain()
        return False

    with (stub_pod(tiny_dir, answer=breaks_off, role="prefill") as prefill,
          stub_pod(tiny_dir, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32) as (url, router)):
        reply = httpx.post(url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == " Paris"
    assert len(prefill.bodies) == 1 and len(decode.bodies) == 1
    assert KV_TRANSFER_FIELD not in decode.bodies[0]  # served whole: nothing to pull
    assert all(p.inflight == 0 for p in router.pods.pods.values())


def test_a_decode_pod_answering_no_json_is_an_error_with_a_message_not_a_bare_500(tiny_dir: Path) -> None:
    async def hands_off(body: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_reply(prefill_answer(body)))
        await writer.drain()
        return True

    async def crashes(body: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\noops!")
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=hands_off, role="prefill") as prefill,
          stub_pod(tiny_dir, answer=crashes, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32) as (url, router)):
        reply = httpx.post(url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5}, timeout=30)
    assert reply.status_code == 502
    assert "not a JSON object" in reply.json()["error"]["message"] and "oops!" in reply.json()["error"]["message"]
    assert decode.bodies[0][KV_TRANSFER_FIELD]["handle"] == "h"
    assert outcomes(router) == {("error", "disaggregated", "client"): 1}


def test_decode_pods_gone_during_a_failed_prefill_hop_are_not_asked(tiny_dir: Path) -> None:
    """The request is decided before its prefill hop; when the hop fails it is served whole, decided again: the
    decode pod chosen first left the pool meanwhile (a scale-in), so the answer is a 503 to retry, not a 500."""
    left = threading.Event()

    async def slow_then_broken(body: dict, writer: asyncio.StreamWriter) -> bool:
        while not left.is_set():
            await asyncio.sleep(0.02)
        return False  # closed without an answer

    with (stub_pod(tiny_dir, answer=slow_then_broken, role="prefill") as prefill,
          stub_pod(tiny_dir, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32) as (url, router)):
        loop = next(iter(router.pods._tasks.values()))[0].get_loop()

        def scale_in() -> None:
            while not prefill.bodies:
                time.sleep(0.02)
            loop.call_soon_threadsafe(router.pods.remove, decode.url)
            time.sleep(0.2)
            left.set()

        remover = threading.Thread(target=scale_in)
        remover.start()
        reply = httpx.post(url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5}, timeout=30)
        remover.join()
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "no_pod"
    assert decode.bodies == []


def test_a_long_answer_past_the_read_timeout_is_a_504_from_one_pod_not_a_run_on_every_pod(tiny_dir: Path) -> None:
    async def slow(body: dict, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(1.5)  # generating, past the router's 0.5 s
        writer.write(json_reply(prefill_answer(body)))
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=slow) as a, stub_pod(tiny_dir, answer=slow) as b,
          routed(tiny_dir, [a.url, b.url], request_timeout_seconds=0.5) as (url, router)):
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5}, timeout=30)
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "upstream_timeout"
    assert len(a.bodies) + len(b.bodies) == 1
    assert outcomes(router) == {("error", "aggregated", "client"): 1}


def test_a_streaming_client_that_leaves_during_the_prefill_hop_starts_no_decode(tiny_dir: Path) -> None:
    async def slow_prefill(body: dict, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(1.0)
        writer.write(json_reply(prefill_answer(body)))
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=slow_prefill, role="prefill") as prefill,
          stub_pod(tiny_dir, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32) as (url, router)):
        body = {"prompt": LONG_PROMPT, "max_tokens": 5, "stream": True}
        with contextlib.suppress(httpx.ReadTimeout):  # the client gives up
            httpx.post(url + "/v1/completions", json=body, timeout=0.3)
        time.sleep(1.5)  # past the prefill pod's answer
        assert prefill.bodies and decode.bodies == []
        counted(router, {("client_gone", "aggregated", "client"): 1})


def test_a_stream_whose_pod_goes_silent_and_stops_answering_health_checks_moves_on(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod sends a token, then nothing, its connection still open (a hung process, a lost node): once its
    health checks have failed for LOST_AFTER_SECONDS (shortened here), the router breaks the connection and the
    stream goes on from another pod, instead of waiting out request_timeout_seconds (10 minutes by default)."""
    monkeypatch.setattr(pods_module, "LOST_AFTER_SECONDS", 0.5)
    stubs: dict[int, Stub] = {}  # by port
    hung: list[Stub] = []

    async def first_hangs_then_others_finish(body: dict, writer: asyncio.StreamWriter) -> bool:
        if not hung:  # the first pod asked: one token, then silence, and its host stops answering
            hung.append(stubs[writer.get_extra_info("sockname")[1]])
            first = text_chunk(0, " a")
            first["choices"][0]["token_ids"] = [7]
            writer.write(SSE_HEAD + sse(first))
            await writer.drain()
            hung[0].healthy = False
            await asyncio.sleep(3600)
            return False
        last = text_chunk(0, " b", "length")
        last["choices"][0]["token_ids"] = [8]
        writer.write(SSE_HEAD + sse(last) + sse("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=first_hangs_then_others_finish) as a,
          stub_pod(tiny_dir, answer=first_hangs_then_others_finish) as b):
        stubs.update({int(stub.url.rsplit(":", 1)[1]): stub for stub in (a, b)})
        with routed(tiny_dir, [a.url, b.url], request_timeout_seconds=60) as (url, _):
            lines = stream_lines(url, {"prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=20)
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")]
    assert texts == [" a", " b"] and lines[-1] == "data: [DONE]"
    spare = {a.url: b, b.url: a}[hung[0].url]
    assert spare.bodies[0]["resume_output_ids"] == [7]


def test_a_prefill_hop_past_the_read_timeout_is_served_whole_not_a_504(tiny_dir: Path) -> None:
    async def stalls(body: dict, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(3600)
        return False

    with (stub_pod(tiny_dir, answer=stalls, role="prefill") as prefill,
          stub_pod(tiny_dir, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32, request_timeout_seconds=0.5) as (
              url, _)):
        reply = httpx.post(url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert KV_TRANSFER_FIELD not in decode.bodies[0]


def test_an_event_line_that_is_not_utf8_ends_the_stream_with_an_error_counted_as_one(tiny_dir: Path) -> None:
    async def garbles(body: dict, writer: asyncio.StreamWriter) -> bool:
        bad = b"data: {\"x\": \"\xff\xfe\"}\n\n"
        writer.write(SSE_HEAD + sse(text_chunk(0, " a")) + b"%x\r\n%s\r\n" % (len(bad), bad))
        await writer.drain()
        return True

    with stub_pod(tiny_dir, answer=garbles) as pod, routed(tiny_dir, [pod.url]) as (url, router):
        lines = stream_lines(url, {"prompt": "Hi", "max_tokens": 5, "n": 2, "stream": True})
        assert "error" in json.loads(lines[-2].removeprefix("data: ")) and lines[-1] == "data: [DONE]"
        counted(router, {("error", "aggregated", "client"): 1})


def test_events_without_a_space_after_data_are_read_as_the_same_events(tiny_dir: Path) -> None:
    """`data:{...}` is `data: {...}` to the SSE spec (a pod of another make, or a proxy that rewrites events). Read as
    unknown lines, the answer looked unfinished and was run again on the other pod: the client got it twice, then
    an error."""
    def bare(event: dict | str) -> bytes:
        data = f"data:{event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def no_space(body: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD + bare(text_chunk(0, " Paris")) + bare(text_chunk(0, ".", "length")) + bare("[DONE]")
                     + b"0\r\n\r\n")
        await writer.drain()
        return True

    with stub_pod(tiny_dir, answer=no_space) as a, stub_pod(tiny_dir, answer=no_space) as b, \
            routed(tiny_dir, [a.url, b.url]) as (url, router):
        lines = stream_lines(url, {"prompt": "Hi", "max_tokens": 2, "stream": True})
        texts = [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines[:-1]]
        assert texts == [" Paris", "."] and lines[-1] == "data: [DONE]"
        assert len(a.bodies) + len(b.bodies) == 1
        counted(router, {("ok", "aggregated", "client"): 1})
