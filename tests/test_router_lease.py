"""A tenant's Lease (router/limits.py), from `Limiter.open` to `Lease.close`, on every way a request ends, each
found by a review: a request cancelled while a thread tokenizes its body gave its concurrency slot back before the
thread was done; a gateway's body in two BUFFERED messages was admitted twice and one of its slots held forever;
refusals charged a request without saying the tenant's x-ratelimit-* headers; a pod's usage with nulls kept a
streamed request's slot. A keyed router in front of the tiny engine in-process, its limiter's clock injected, and
routers in front of stub pods for the usage a real engine never sends."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvmesh.router.app import Router
from kvmesh.router.asgi import RouteError
from kvmesh.router.config import INLINE_TOKENIZE_BYTES, MAX_REQUEST_BODY_BYTES
from kvmesh.router.extproc import Exchange, Refused
from kvmesh.router.limits import Limiter, parse_tenants

from .engines import keyed_pool
from .test_router_broken_reply import SSE_HEAD, json_reply, routed, sse, stub_pod, text_chunk
from .test_router_extproc import request_headers, response_phases
from .test_router_limits import Clock

KEYS = {"acme": "sk-acme-lease"}
RPM = 100
TENANTS = {"acme": {"requests_per_minute": RPM, "max_concurrent_requests": 1}}
AUTH = {"authorization": f"Bearer {KEYS['acme']}"}
NULL_USAGE = {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None,
              "prompt_tokens_details": {"cached_tokens": None}}
# usage a real engine never sends: nulls, no object at all, details of the wrong shape
ODD_USAGES = pytest.mark.parametrize("usage", [NULL_USAGE, ["not", "an", "object"],
                                               {"completion_tokens": 1, "prompt_tokens_details": [3]}],
                                     ids=["nulls", "a-list", "details-a-list"])


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Router]]:
    with keyed_pool(tiny_dir, tmp_path_factory.mktemp("lease"), KEYS, TENANTS) as served:
        yield served


@pytest.fixture
def served(pool: tuple[str, Router]) -> tuple[str, Router]:
    """The module's router with fresh buckets on a clock that never moves."""
    url, router = pool
    router.limits = Limiter(parse_tenants(TENANTS), clock=Clock())
    return url, router


def remaining_requests(router: Router) -> str:
    """What acme's requests bucket holds, as x-ratelimit-remaining-requests says it."""
    bucket = router.limits._of("acme").requests
    assert bucket is not None
    return str(math.floor(bucket.available(router.limits.clock())))


async def settled(router: Router) -> dict[str, int]:
    """The tenants' requests in flight once the callbacks due have run (a bounded wait, never a timing check)."""
    for _ in range(3000):  # 30 s: the bound only ends a failing test
        if not router.limits.inflight:
            break
        await asyncio.sleep(0.01)
    return dict(router.limits.inflight)


# ---- a request cancelled while a thread works on its body ---------------------------------------------------------


def test_a_request_cancelled_while_its_body_is_tokenized_holds_its_slot_until_the_tokenizing_ends(
        served: tuple[str, Router], monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway's stream gone (or a batch stopped) cancels admission; the slot came back at once while the thread
    went on tokenizing, so a tenant limited to one request at a time could have any number of large bodies
    tokenized at once by aborting each. Now the slot comes back when the thread is done: the next request is a 429
    meanwhile."""
    _, router = served
    entered, release = threading.Event(), threading.Event()
    measure = router.measure

    def held(*args: Any) -> Any:  # the first tokenizing waits for the test; any other passes
        if not entered.is_set():
            entered.set()
            assert release.wait(60)
        return measure(*args)

    monkeypatch.setattr(router, "measure", held)
    padded = b'{"prompt": [100, 101], "max_tokens": 1}' + b" " * (INLINE_TOKENIZE_BYTES + 1)  # tokenized off the loop

    async def scenario() -> tuple[dict[str, int], RouteError, dict[str, int]]:
        first = asyncio.ensure_future(router.admit(padded, AUTH, chat=False))
        try:
            assert await asyncio.to_thread(entered.wait, 60)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            during = dict(router.limits.inflight)
            with pytest.raises(RouteError) as second:
                await router.admit(b'{"prompt": [100], "max_tokens": 1}', AUTH, chat=False)
        finally:
            release.set()
        return during, second.value, await settled(router)

    during, second, after = asyncio.run(scenario())
    assert during == {"acme": 1}  # the cancelled request's body is still being tokenized
    assert second.status == 429 and "concurrent requests: limit 1" in second.message
    assert after == {}  # back once the thread was done, exactly once


# ---- a gateway's BUFFERED body in more than one message -----------------------------------------------------------


def test_a_buffered_body_in_two_messages_is_admitted_and_booked_once(served: tuple[str, Router]) -> None:
    """BUFFERED mode decided on every body message: a body then an empty last message admitted the request twice,
    and the stream's end closed only the last choice, so one slot and one pod's in-flight count were held until the
    router restarted. Now the request is decided once, and a body message after it is refused; the stream's end
    gives back what the one decision took."""
    _, router = served
    router.limits = Limiter(parse_tenants({"acme": {**TENANTS["acme"], "max_concurrent_requests": 2}}), clock=Clock())
    body = json.dumps({"prompt": [100, 101, 102], "max_tokens": 1}).encode()

    async def scenario() -> tuple[int, dict[str, int]]:
        exchange = Exchange(router)
        await exchange.on(request_headers(mode=ProcessingMode.BUFFERED, **AUTH))
        await exchange.on(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False)))
        with pytest.raises(Refused) as again:
            await exchange.on(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"", end_of_stream=True)))
        in_flight = dict(router.limits.inflight)
        exchange.finish(cancelled=True)
        return again.value.status, in_flight

    status, in_flight = asyncio.run(scenario())
    assert status == 500
    assert in_flight == {"acme": 1}  # admitted once
    assert remaining_requests(router) == str(RPM - 1)
    assert router.limits.inflight == {}
    assert all(pod.inflight == 0 for pod in router.pods.pods.values())


# ---- refusals that charge a request say the tenant's limits --------------------------------------------------------


def post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(url + path, content=body, timeout=60, headers={**AUTH, "content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/completions", b'{"prompt": ', 400),  # no JSON
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "x"}', 400),  # a bad field
    ("/v1/responses", b"{", 400),
    ("/v1/responses", b'{"input": "hi", "previous_response_id": "resp_unknown"}', 404),
    ("/v1/responses", b'{"input": "hi", "tool_choice": "zzz"}', 400),
    ("/v1/responses", b'{"input": "' + b"x" * (MAX_REQUEST_BODY_BYTES + 1) + b'"}', 413),
], ids=["completion-json", "completion-field", "response-json", "response-previous", "response-field",
        "response-size"])
def test_a_refusal_that_charges_a_request_says_the_tenants_limits(served: tuple[str, Router], path: str, body: bytes,
                                                                   status: int) -> None:
    """OpenAI sends x-ratelimit-* on every answer, and the router on its others: these refusals took one of the
    tenant's requests and said nothing of what was left."""
    url, router = served
    refused = post(url, path, body)
    assert refused.status_code == status, refused.text
    assert remaining_requests(router) == str(RPM - 1)  # charged
    assert refused.headers["x-ratelimit-remaining-requests"] == str(RPM - 1)
    assert refused.headers["x-ratelimit-limit-requests"] == str(RPM)
    assert router.limits.inflight == {}


# ---- a pod's usage with nulls --------------------------------------------------------------------------------------


@ODD_USAGES
def test_a_gateway_answer_whose_usage_has_nulls_gives_the_slot_back(served: tuple[str, Router], usage: Any) -> None:
    """The stream's end charged `completion_tokens + ...` with null from a pod of another make: a TypeError before
    the slot came back, and nothing else closes a gateway request's lease."""
    _, router = served
    body = json.dumps({"prompt": [100, 101, 102], "max_tokens": 1}).encode()
    answer = json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [], "usage": usage}).encode()

    async def scenario() -> None:
        exchange = Exchange(router)
        await exchange.on(request_headers(mode=ProcessingMode.BUFFERED, **AUTH))
        await exchange.on(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        for message in response_phases(answer):
            await exchange.on(message)
        exchange.finish(cancelled=False)

    asyncio.run(scenario())
    assert router.limits.inflight == {}
    assert all(pod.inflight == 0 for pod in router.pods.pods.values())


@ODD_USAGES
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_pod_answering_usage_with_nulls_is_served_and_gives_the_slot_back(tiny_dir: Path, stream: bool,
                                                                            usage: Any) -> None:
    """A relayed stream's end raised the TypeError: its slot was held until the router restarted (a whole answer
    was a 500)."""
    odd = usage

    async def nulls(body: dict, writer: asyncio.StreamWriter) -> bool:
        usage = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub", "choices": [],
                 "usage": odd}
        if body.get("stream"):
            writer.write(SSE_HEAD + sse(text_chunk(0, " a", "length")) + sse(usage) + sse("[DONE]") + b"0\r\n\r\n")
        else:
            writer.write(json_reply({**text_chunk(0, " a", "length"), "usage": odd}))
        await writer.drain()
        return True

    with stub_pod(tiny_dir, answer=nulls) as pod, routed(tiny_dir, [pod.url]) as (url, router):
        router.limits = Limiter(parse_tenants({"default": {"max_concurrent_requests": 1}}), clock=Clock())
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 1, "stream": stream}) as reply:
            text = reply.read().decode()
        assert reply.status_code == 200, text
        assert " a" in text
        assert asyncio.run(settled(router)) == {}
