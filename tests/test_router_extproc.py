"""The router as a Gateway API Inference Extension endpoint picker: a real gRPC client drives ext_proc streams as
Envoy does (headers, then the body in one or several chunks, then the response phases) against the router.

The fast tests run the ext_proc server over a router whose two pods are never contacted: their health, load and
cached blocks are set by hand (the state the scraper and the event reader would fill in), so each decision is
known in advance; they speak plaintext gRPC, and the TLS tests (a self-signed certificate, a mounted pair that is
rotated, a plaintext client refused, bad certificate directories) use TLS. The slow test runs it inside the router
app, over TLS with a mounted pair, in front of two real tiny engines, beside the HTTP edge, and checks both edges
choose alike from the same state."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from fastapi.testclient import TestClient
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh import cli
from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.engine.protocol import KVConfig, KVEvent, KVEventBatch, RouterMetric
from kvmesh.engine.tracing import ROUTER_SERVICE, setup_tracing
from kvmesh.processes import free_port
from kvmesh.router.app import Router, build_router, create_router_app
from kvmesh.router.auth import ApiKeys, cache_salt_for, hash_key
from kvmesh.router.config import RouterConfig, load_router_config
from kvmesh.router.extproc import (
    BODY_CHUNK_BYTES,
    MAX_BODY_BYTES,
    endpoint_of,
    parse_subset,
    self_signed_certificate,
    start_ext_proc,
)
from kvmesh.router.limits import Limiter, parse_tenants

from .engines import serve_router, tiny_engines
from .waiting import eventually

POD_A, POD_B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
MODEL = "tiny"


# ---- a router whose pod state the test sets -------------------------------------------------------------------


@pytest.fixture
def router(bundled_dir: Path) -> Router:
    r = build_router(RouterConfig(pods=[POD_A, POD_B], stale_after_seconds=3600.0), bundled_dir)
    for pod in r.pods.pods.values():
        pod.healthy = True
        pod.scraped_at = time.monotonic()
        pod.kv_config = KVConfig(model=MODEL, block_size=16, hash_algo=r.config.hash_algo, hash_root=r.config.hash_root,
                                 tokenizer_fingerprint=r.tokenizer.fingerprint, num_device_blocks=1000, boot_id="b")
        pod.metrics = {"num_blocks": 1000.0, "block_size": 16.0}
    return r


@pytest_asyncio.fixture
async def picker(router: Router) -> AsyncIterator[tuple[Router, pb_grpc.ExternalProcessorStub, grpc.aio.Channel]]:
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)  # the protocol, in plaintext
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield router, pb_grpc.ExternalProcessorStub(channel), channel
    await server.stop()


def prompt(seed: int, n: int = 96) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def hold(router: Router, pod: str, body: dict[str, object]) -> None:
    """`pod` reports (a KV event) that it caches the blocks of `body`'s prompt."""
    hashes = router.request_info(CompletionRequest.model_validate(body), 0).block_hashes
    seq = router.index.resume_point(pod)[1] + 1
    assert router.index.apply(pod, KVEventBatch("b", seq, (KVEvent("stored", hashes, "device", None, 16),)))


def request_headers(path: str = "/v1/completions", method: str = "POST", end_of_stream: bool = False,
                    mode: int | None = ProcessingMode.FULL_DUPLEX_STREAMED, subset: list[str] | None = None,
                    response_mode: int | None = None, **extra: str) -> pb.ProcessingRequest:
    """The first message of a stream; `mode` None sends no protocol_config (an Envoy before 1.34)."""
    headers = {":method": method, ":path": path, ":authority": "gateway", "content-type": "application/json", **extra}
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in headers.items()]),
        end_of_stream=end_of_stream))
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = mode if response_mode is None else response_mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_chunks(payload: bytes, pieces: int = 1) -> list[pb.ProcessingRequest]:
    size = -(-len(payload) // pieces)
    parts = [payload[i:i + size] for i in range(0, len(payload), size)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=part, end_of_stream=i == len(parts) - 1))
            for i, part in enumerate(parts)]


def response_phases(answer: bytes | list[bytes], status: int = 200, content_type: str = "application/json"
                    ) -> list[pb.ProcessingRequest]:
    """The engine's answer as the gateway shows it: headers, the body (in the chunks given), an empty last chunk,
    trailers."""
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                                          base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())])
    chunks = answer if isinstance(answer, list) else [answer]
    return [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers)),
            *(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=False)) for chunk in chunks),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers())]


async def full_duplex(stub: pb_grpc.ExternalProcessorStub, messages: list[pb.ProcessingRequest]
                      ) -> list[pb.ProcessingResponse]:
    """Envoy in FULL_DUPLEX_STREAMED mode: every message sent without waiting; every reply read to the end."""
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    return [reply async for reply in stub.Process(requests())]


def destination(reply: pb.ProcessingResponse, phase: str = "request_headers") -> list[str]:
    """The endpoints a reply names, chosen first, checking the header and the metadata agree (the protocol
    requires it)."""
    common = getattr(reply, phase).response
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert common.clear_route_cache
    assert headers["x-gateway-destination-endpoint"] == metadata["x-gateway-destination-endpoint"].string_value
    return headers["x-gateway-destination-endpoint"].split(",")


def chosen(reply: pb.ProcessingResponse, phase: str = "request_headers") -> str:
    """The endpoint a reply chooses: the first of the list."""
    return destination(reply, phase)[0]


def refusal(reply: pb.ProcessingResponse) -> tuple[int, dict[str, object], dict[str, str]]:
    assert reply.WhichOneof("response") == "immediate_response", reply
    immediate = reply.immediate_response
    assert immediate.details.startswith("kvmesh_") and not any(c.isspace() for c in immediate.details)
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, json.loads(immediate.body), headers


def completion(seed: int, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt(seed), "max_tokens": 4, **extra}


# ---- fast tests ---------------------------------------------------------------------------------------------


def test_endpoints_and_subsets_parse_as_the_gateway_writes_them() -> None:
    assert endpoint_of("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert endpoint_of("http://[fd00::1]:8000/") == "[fd00::1]:8000"
    assert endpoint_of("https://engine.local") == "engine.local:443"
    assert parse_subset({}) is None
    assert parse_subset({"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": []}}) == set()
    hint = {"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "10.0.0.2:8000, 10.0.0.3"]}
    assert parse_subset({"envoy.lb.subset_hint": hint}) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3"}


@pytest.mark.parametrize("holder", [POD_A, POD_B])
@pytest.mark.asyncio
async def test_full_duplex_picks_the_pod_holding_the_prefix_as_the_http_path_does(picker, holder: str) -> None:
    router, stub, _ = picker
    body = completion(1)
    hold(router, holder, body)
    payload = json.dumps(body).encode()
    info = router.request_info(CompletionRequest.model_validate(body), 0)
    http_choice = router.decide(info, set()).pod  # what the HTTP edge would choose from this state
    assert http_choice is not None and http_choice.name == holder

    answer = b'{"usage": {"prompt_tokens": 96, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 80}}}'
    replies = await full_duplex(stub, [request_headers(), *body_chunks(payload, 3), *response_phases(answer)])

    phases = [r.WhichOneof("response") for r in replies]
    assert phases == ["request_headers", "request_body", "response_headers", "response_body", "response_body",
                      "response_trailers"]
    assert chosen(replies[0]) == endpoint_of(holder)
    echoed = replies[1].request_body.response.body_mutation.streamed_response
    assert echoed.body == payload and echoed.end_of_stream  # the body goes upstream unchanged
    assert replies[3].response_body.response.body_mutation.streamed_response.body == answer  # the answer too
    assert replies[4].response_body.response.body_mutation.streamed_response.end_of_stream

    # the decision is booked as the HTTP path books it: provisional blocks, metrics; in flight until the stream ends
    assert router.index.match(info.block_hashes, [holder], time.monotonic())[holder].blocks == len(info.block_hashes)
    assert all(p.inflight == 0 for p in router.pods.pods.values())
    metrics = router.metrics
    assert metrics.requests.labels("ok", "gateway", "client")._value.get() == 1
    assert metrics.decisions.labels("prefix")._value.get() == 1
    assert metrics.actual._value.get() == 80


@pytest.mark.asyncio
async def test_a_gateway_choice_is_remembered_for_the_next_request(picker) -> None:
    _, stub, _ = picker
    first = json.dumps(completion(2)).encode()
    replies = await full_duplex(stub, [request_headers(), *body_chunks(first)])
    picked = chosen(replies[0])
    again = json.dumps(completion(2, max_tokens=9)).encode()  # the same prompt: its blocks are provisional there
    for _ in range(3):
        assert chosen((await full_duplex(stub, [request_headers(), *body_chunks(again)]))[0]) == picked


@pytest.mark.asyncio
async def test_a_pod_that_lacks_the_prefix_is_told_to_pull_it_from_its_holder(picker) -> None:
    """As on the HTTP edge: the holder is saturated, so the other pod is chosen, and fetching the prefix from the
    holder is cheaper than computing it, so the body the gateway forwards asks for the pull."""
    router, stub, _ = picker
    body = completion(10)
    hold(router, POD_A, body)
    router.pods.pods[POD_A].metrics["waiting"] = 100.0  # past max_waiting: saturated
    for pod in (POD_A, POD_B):  # pods that store blocks alike: a pull between them can be planned
        router.pods.pods[pod].kv_config = dataclasses.replace(router.pods.pods[pod].kv_config, block_bytes=4096)
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(body).encode())])
    assert destination(replies[0]) == [endpoint_of(POD_B)]  # the pull's source is no fallback: it would pull itself
    forwarded = replies[1].request_body.response.body_mutation.streamed_response.body
    assert json.loads(forwarded) == {**body, "kv_transfer": {"mode": "pull", "source": POD_A, "tokens": 80}}
    headers = {h.header.key: h.header.raw_value.decode()
               for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert headers["content-length"] == str(len(forwarded))
    assert router.metrics.pulls._value.get() == 1


@pytest.mark.asyncio
async def test_request_trailers_end_the_body_too(picker) -> None:
    _, stub, _ = picker
    payload = json.dumps(completion(13)).encode()
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=payload, end_of_stream=False))
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    replies = await full_duplex(stub, [request_headers(), body, trailers])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "request_trailers"]
    echoed = replies[1].request_body.response.body_mutation.streamed_response
    assert echoed.body == payload and not echoed.end_of_stream  # the trailers end the request


@pytest.mark.asyncio
async def test_a_large_body_is_handed_back_in_chunks_envoy_accepts(picker) -> None:
    _, stub, _ = picker
    payload = json.dumps(completion(3, user="x" * 150_000)).encode()
    replies = await full_duplex(stub, [request_headers(), *body_chunks(payload, 7)])
    assert replies[0].WhichOneof("response") == "request_headers"
    pieces = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert len(pieces) == -(-len(payload) // BODY_CHUNK_BYTES)
    assert all(len(p.body) <= BODY_CHUNK_BYTES for p in pieces)
    assert b"".join(p.body for p in pieces) == payload
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]


@pytest.mark.asyncio
async def test_buffered_mode_answers_the_headers_then_decides_on_the_body(picker) -> None:
    router, stub, _ = picker
    body = completion(4)
    hold(router, POD_B, body)
    call = stub.Process()
    await call.write(request_headers(mode=ProcessingMode.BUFFERED))
    first = await call.read()  # Envoy waits for this before it sends the body
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.write(body_chunks(json.dumps(body).encode())[0])
    second = await call.read()
    assert second.WhichOneof("response") == "request_body"
    assert chosen(second, "request_body") == endpoint_of(POD_B)
    assert not second.request_body.response.HasField("body_mutation")  # the body goes on as the client sent it
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


@pytest.mark.asyncio
async def test_the_gateway_subset_limits_the_choice(picker) -> None:
    router, stub, _ = picker
    body = completion(5)
    hold(router, POD_A, body)
    payload = json.dumps(body).encode()
    only_b = request_headers(subset=[endpoint_of(POD_B)])
    assert chosen((await full_duplex(stub, [only_b, *body_chunks(payload)]))[0]) == endpoint_of(POD_B)
    by_ip = request_headers(subset=["10.0.0.2"])  # a bare address allows any of its ports
    assert chosen((await full_duplex(stub, [by_ip, *body_chunks(payload)]))[0]) == endpoint_of(POD_B)
    elsewhere = request_headers(subset=["10.9.9.9:8000"])
    status, error, _ = refusal((await full_duplex(stub, [elsewhere, *body_chunks(payload)]))[0])
    assert status == 503 and "subset" in error["error"]["message"]


@pytest.mark.parametrize(("payload", "message"), [
    (b'{"model": "tiny", "prompt": [1, 2', "malformed JSON"),
    (b'{"model": "tiny", "max_tokens": 4}', "prompt"),
])
@pytest.mark.asyncio
async def test_a_bad_body_gets_400(picker, payload: bytes, message: str) -> None:
    _, stub, _ = picker
    replies = await full_duplex(stub, [request_headers(), *body_chunks(payload, 2)])
    assert len(replies) == 1
    status, error, headers = refusal(replies[0])
    assert status == 400 and message in error["error"]["message"] and headers["content-type"] == "application/json"


@pytest.mark.asyncio
async def test_an_unknown_model_gets_404(picker) -> None:
    _, stub, _ = picker
    payload = json.dumps({**completion(6), "model": "other"}).encode()
    status, error, _ = refusal((await full_duplex(stub, [request_headers(), *body_chunks(payload)]))[0])
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert error["error"]["param"] == "model"  # as the router's HTTP edge and the engine name it


@pytest.mark.asyncio
async def test_no_healthy_pod_gets_503(picker) -> None:
    router, stub, _ = picker
    for pod in router.pods.pods.values():
        pod.healthy = False
    payload = json.dumps(completion(7)).encode()
    status, error, headers = refusal((await full_duplex(stub, [request_headers(), *body_chunks(payload)]))[0])
    assert status == 503 and error["error"]["code"] == "no_pod" and headers["retry-after"] == "1"
    assert router.metrics.requests.labels("no_pod", "gateway", "client")._value.get() == 1


@pytest.mark.asyncio
async def test_an_overloaded_pool_sheds_by_priority_with_429(picker) -> None:
    router, stub, _ = picker
    for pod in router.pods.pods.values():
        pod.metrics["overload_probability"] = 0.99  # past the default 0.9 shedding threshold
    payload = json.dumps(completion(8)).encode()
    status, error, headers = refusal((await full_duplex(stub, [request_headers(), *body_chunks(payload)]))[0])
    assert status == 429 and error["error"]["code"] == "overloaded" and int(headers["retry-after"]) >= 1
    important = request_headers(**{"x-kvmesh-priority": "3"})
    assert chosen((await full_duplex(stub, [important, *body_chunks(payload)]))[0]) in map(endpoint_of, (POD_A, POD_B))
    bad = request_headers(**{"x-kvmesh-priority": "high"})
    status, error, _ = refusal((await full_duplex(stub, [bad, *body_chunks(payload)]))[0])
    assert status == 400 and "x-kvmesh-priority" in error["error"]["message"]


@pytest.mark.asyncio
async def test_the_engine_gets_the_priority_and_class_admission_settled_not_the_clients(picker) -> None:
    """The gateway forwards the client's headers to the engine, whose queue orders by x-kvmesh-priority: the picker
    overwrites it with the priority lowered to the tenant's ceiling, and the workload class with the one derived
    (a tenant not trusted to name it), on the HTTP edge's rule."""
    router, stub, _ = picker
    router.keys = ApiKeys({hash_key("sk-a"): "acme"})
    router.limits = Limiter(parse_tenants({"acme": {"max_priority": 1}}))
    asking = request_headers(authorization="Bearer sk-a", **{"x-kvmesh-priority": "2147483647",
                                                              "x-kvmesh-workload": "chat-long"})
    replies = await full_duplex(stub, [asking, *body_chunks(json.dumps(completion(31)).encode())])
    mutation = {h.header.key: h.header.raw_value.decode()
                for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert (mutation["x-kvmesh-priority"], mutation["x-kvmesh-workload"]) == ("1", "completion-short")
    assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
               for h in replies[0].request_headers.response.header_mutation.set_headers
               if h.header.key.startswith("x-kvmesh-"))


@pytest.mark.asyncio
async def test_the_models_list_is_answered_by_the_picker_in_any_body_mode(picker) -> None:
    """No one pod has the pool's list (each lists only its own LoRA adapters): the picker answers it."""
    _, stub, _ = picker
    for mode in (ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.BUFFERED, ProcessingMode.NONE):
        replies = await full_duplex(stub, [request_headers("/v1/models", "GET", end_of_stream=True, mode=mode)])
        status, body, headers = refusal(replies[0])
        assert len(replies) == 1 and status == 200 and headers["content-type"] == "application/json"
        assert [m["id"] for m in body["data"]] == [MODEL]


@pytest.mark.asyncio
async def test_a_body_mode_that_cannot_carry_a_choice_is_refused_clearly(picker) -> None:
    _, stub, _ = picker
    replies = await full_duplex(stub, [request_headers(mode=ProcessingMode.STREAMED)])
    status, error, _ = refusal(replies[0])
    assert status == 500 and "FULL_DUPLEX_STREAMED" in error["error"]["message"]


@pytest.mark.asyncio
async def test_the_next_best_pods_follow_the_choice_as_fallbacks(picker) -> None:
    """The protocol's list: a gateway set to retry goes down it in order when the chosen pod fails; as many
    fallbacks as the router's own `retries`, none when that is 0."""
    router, stub, _ = picker
    body = completion(21)
    hold(router, POD_B, body)
    payload = json.dumps(body).encode()
    replies = await full_duplex(stub, [request_headers(), *body_chunks(payload)])
    assert destination(replies[0]) == [endpoint_of(POD_B), endpoint_of(POD_A)]
    router.config.retries = 0
    replies = await full_duplex(stub, [request_headers(), *body_chunks(payload)])
    assert destination(replies[0]) == [endpoint_of(POD_B)]


@pytest.mark.asyncio
async def test_a_fallback_that_served_the_request_holds_it(picker) -> None:
    """The gateway reports which endpoint served: when it fell back, the in-flight count the picker reads moves
    to that pod for the rest of the stream, and the request counts as retried."""
    router, stub, _ = picker
    body = completion(22)
    hold(router, POD_A, body)
    call = stub.Process()
    await call.write(request_headers())
    for message in body_chunks(json.dumps(body).encode()):
        await call.write(message)
    first = await call.read()
    assert destination(first) == [endpoint_of(POD_A), endpoint_of(POD_B)]
    await call.read()  # the body, echoed
    assert (router.pods.pods[POD_A].inflight, router.pods.pods[POD_B].inflight) == (1, 0)
    start, *rest = response_phases(b'{"usage": {"prompt_tokens": 96, "completion_tokens": 4}}')
    served = struct_pb2.Struct()
    served.update({"x-gateway-destination-endpoint-served": endpoint_of(POD_B)})
    start.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    await call.write(start)
    await call.read()
    assert (router.pods.pods[POD_A].inflight, router.pods.pods[POD_B].inflight) == (0, 1)
    for message in rest:
        await call.write(message)
        await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert sum(p.inflight for p in router.pods.pods.values()) == 0
    assert router.metrics.retries._value.get() == 1
    assert router.metrics.requests.labels("ok", "gateway", "client")._value.get() == 1


@pytest.mark.asyncio
async def test_a_stream_the_gateway_abandons_gives_the_pod_back(picker) -> None:
    router, stub, _ = picker
    call = stub.Process()
    await call.write(request_headers())
    for message in body_chunks(json.dumps(completion(9)).encode()):
        await call.write(message)
    assert [(await call.read()).WhichOneof("response") for _ in range(2)] == ["request_headers", "request_body"]
    assert sum(p.inflight for p in router.pods.pods.values()) == 1  # the request is in flight on its pod
    start, first_chunk = response_phases(b"data: {}\n\n")[:2]
    for message in (start, first_chunk):  # the answer begins...
        await call.write(message)
        await call.read()
    call.cancel()  # ...and the client goes away before it ends
    gone = router.metrics.requests.labels("client_gone", "gateway", "client")
    for _ in range(500):  # the server sees the cancellation a moment later
        if gone._value.get():
            break
        await asyncio.sleep(0.01)
    assert gone._value.get() == 1
    assert sum(p.inflight for p in router.pods.pods.values()) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True])
async def test_a_taken_port_is_a_clear_error(router: Router, tls: bool) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="cannot listen for ext_proc"):
            await start_ext_proc(router, "127.0.0.1", taken.getsockname()[1], tls=tls)


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")  # whether the picker can pick


def health_checker(channel: grpc.aio.Channel) -> tuple[health_pb2_grpc.HealthStub, Callable[[str], Awaitable[int]]]:
    """The gRPC project's health client, and its Check as service name -> status."""
    stub = health_pb2_grpc.HealthStub(channel)

    async def check(service: str) -> int:
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

    return stub, check


@pytest.mark.asyncio
async def test_grpc_health_checking_says_whether_the_picker_can_pick(picker) -> None:
    router, _, channel = picker
    _, check = health_checker(channel)
    assert [await check(s) for s in (*SERVICES, "liveness")] == [SERVING] * 4
    for pod in router.pods.pods.values():
        pod.draining = True
    assert [await check(s) for s in (*SERVICES, "liveness")] == [NOT_SERVING] * 3 + [SERVING]  # but alive
    for pod in router.pods.pods.values():
        pod.draining, pod.healthy = False, pod.name == POD_A
    assert [await check(s) for s in SERVICES] == [SERVING] * 3  # one healthy pod will do
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await check("something.Else")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
@pytest.mark.parametrize("service", SERVICES)
async def test_a_health_watch_is_told_when_the_picker_can_no_longer_pick_and_again(picker, service: str) -> None:
    """Watch, as a Gateway may health-check: a new status arrives when pod health changes (the picker looks at the
    scrape interval), with no Check asked in between."""
    router, _, channel = picker
    stub, _ = health_checker(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=service))
    assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
    for pod in router.pods.pods.values():
        pod.healthy = False
    assert (await asyncio.wait_for(watch.read(), 30)).status == NOT_SERVING
    router.pods.pods[POD_B].healthy = True
    assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
    watch.cancel()


# ---- scale from zero: a request held while no pod is ready ----------------------------------------------------


@contextlib.asynccontextmanager
async def holding_picker(bundled_dir: Path, hold_seconds: float
                         ) -> AsyncIterator[tuple[Router, pb_grpc.ExternalProcessorStub, grpc.aio.Channel]]:
    """A picker whose router holds requests up to `hold_seconds` while no pod is ready, over a pool at zero: both
    pods known but not healthy (no engine has started)."""
    router = build_router(RouterConfig(pods=[POD_A, POD_B], stale_after_seconds=3600.0, scrape_interval_seconds=0.05,
                                       hold_without_pods_seconds=hold_seconds), bundled_dir)
    for pod in router.pods.pods.values():
        pod.kv_config = KVConfig(model=MODEL, block_size=16, hash_algo=router.config.hash_algo,
                                 hash_root=router.config.hash_root, tokenizer_fingerprint=router.tokenizer.fingerprint,
                                 num_device_blocks=1000, boot_id="b")
        pod.metrics = {"num_blocks": 1000.0, "block_size": 16.0}
        pod.scraped_at = time.monotonic()
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield router, pb_grpc.ExternalProcessorStub(channel), channel
    finally:
        await server.stop()


def held(router: Router) -> float:
    """kvmesh_router_requests_waiting_for_pods, the gauge the operator starts a pool at zero on."""
    value = router.metrics.registry.get_sample_value(RouterMetric.REQUESTS_WAITING_FOR_PODS)
    assert value is not None
    return value


async def held_stream(router: Router, stub: pb_grpc.ExternalProcessorStub, seed: int) -> grpc.aio.StreamStreamCall:
    """A completion sent whole through a stream as Envoy does, once the router holds it."""
    call = stub.Process()
    await call.write(request_headers())
    for message in body_chunks(json.dumps(completion(seed)).encode()):
        await call.write(message)
    await eventually(lambda: held(router) == 1)
    return call


@pytest.mark.asyncio
async def test_a_request_to_a_pool_at_zero_is_held_and_decided_once_a_pod_is_ready(bundled_dir: Path) -> None:
    async with holding_picker(bundled_dir, 600.0) as (router, stub, channel):
        _, check = health_checker(channel)
        assert await check("readiness") == SERVING  # held requests are served: the Gateway must send them here
        call = await held_stream(router, stub, 40)
        reply = asyncio.ensure_future(call.read())
        router.pods.scraped()  # a scrape that found no pod ready: nothing is answered
        await asyncio.sleep(0.3)
        assert not reply.done() and held(router) == 1
        router.pods.pods[POD_B].healthy = True  # the pool's first engine is up, as its scrape finds it
        router.pods.scraped()
        first = await asyncio.wait_for(reply, 30)
        assert chosen(first) == endpoint_of(POD_B) and held(router) == 0
        assert (await call.read()).WhichOneof("response") == "request_body"
        assert router.pods.pods[POD_B].inflight == 1
        for message in response_phases(b'{"usage": {"prompt_tokens": 96}}'):
            await call.write(message)
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass
    assert counted(router, "ok") == 1 and counted(router, "no_pod") == 0 and router.pods.pods[POD_B].inflight == 0


@pytest.mark.asyncio
async def test_a_request_held_in_vain_gets_the_starting_503_with_retry_after(bundled_dir: Path) -> None:
    async with holding_picker(bundled_dir, 0.2) as (router, stub, _):
        replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(41)).encode())])
    status, error, headers = refusal(replies[0])
    assert len(replies) == 1 and status == 503
    assert error["error"]["code"] == "no_pod" and "starting from zero" in error["error"]["message"]
    assert headers["retry-after"] == "5"  # later than a busy pool's 1 s: the pool is still starting
    assert counted(router, "no_pod") == 1 and held(router) == 0


@pytest.mark.asyncio
async def test_a_held_stream_the_gateway_cancels_leaves_the_gauge_at_once(bundled_dir: Path) -> None:
    """The client left, or the Gateway's message timeout passed: either cancels the stream, and the request no
    longer counts towards starting the pool."""
    async with holding_picker(bundled_dir, 600.0) as (router, stub, _):
        call = await held_stream(router, stub, 42)
        call.cancel()
        await eventually(lambda: held(router) == 0)
        await eventually(lambda: counted(router, "client_gone") == 1)
        router.pods.pods[POD_A].healthy = True  # a pod that starts later is given nothing for it
        router.pods.scraped()
        assert not router.pod_wait or router.pod_wait.held == 0
    assert all(p.inflight == 0 for p in router.pods.pods.values()) and counted(router, "no_pod") == 0


# ---- what may pass, and who may send it ------------------------------------------------------------------------


def counted(router: Router, outcome: str, route: str = "gateway") -> float:
    return router.metrics.requests.labels(outcome, route, "client")._value.get()


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/admin/drain"), ("POST", "/v1/kv/warm"), ("GET", "/v1/kv/hot"), ("GET", "/metrics"),
    ("GET", "/health"), ("POST", "/v1/completions/../admin/drain"), ("POST", "//v1/completions"),
])
@pytest.mark.parametrize("mode", [ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.BUFFERED, ProcessingMode.NONE])
@pytest.mark.asyncio
async def test_only_the_client_api_reaches_an_engine_through_the_gateway(picker, method: str, path: str,
                                                                         mode: int) -> None:
    """An engine's admin and KV endpoints (drain it, make it fetch KV from an address the client names) are never
    named a pod for, with a body or without, in any body mode: the gateway answers 404 itself."""
    router, stub, _ = picker
    warm = json.dumps({"source": "http://attacker.example:8000", "chains": [[1]]}).encode()
    for messages in ([request_headers(path, method, end_of_stream=True, mode=mode)],
                     [request_headers(path, method, mode=mode), *body_chunks(warm)]):
        replies = await full_duplex(stub, messages)
        assert len(replies) == 1
        status, error, _ = refusal(replies[0])
        assert status == 404 and "/v1/chat/completions" in error["error"]["message"]
    assert counted(router, "error") == 2
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_a_known_path_with_the_wrong_method_gets_405(picker) -> None:
    _, stub, _ = picker
    status, error, _ = refusal((await full_duplex(stub, [request_headers(method="GET", end_of_stream=True)]))[0])
    assert status == 405 and "POST" in error["error"]["message"]
    delete = request_headers("/v1/models?x=1", "DELETE", end_of_stream=True)
    assert refusal((await full_duplex(stub, [delete]))[0])[0] == 405


@pytest.mark.asyncio
async def test_every_stream_needs_the_api_key_also_those_decided_at_the_headers(picker) -> None:
    router, stub, _ = picker
    router.keys = ApiKeys({hash_key("sk-acme"): "acme"})
    payload = json.dumps(completion(20)).encode()
    without = [[request_headers("/v1/models", "GET", end_of_stream=True)],
               [request_headers("/v1/models", "GET", end_of_stream=True, mode=ProcessingMode.NONE)],
               [request_headers(authorization="Bearer wrong"), *body_chunks(payload)],
               # the key is checked before the body: no schema is compiled for a client that may not send
               [request_headers(), *body_chunks(json.dumps(completion(20, response_format={
                   "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})).encode())]]
    for messages in without:
        status, error, _ = refusal((await full_duplex(stub, messages))[0])
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
    assert counted(router, "error") == 4
    key = {"authorization": "Bearer sk-acme"}
    models = await full_duplex(stub, [request_headers("/v1/models", "GET", end_of_stream=True, **key)])
    assert refusal(models[0])[0] == 200
    replies = await full_duplex(stub, [request_headers(**key), *body_chunks(payload)])
    forwarded = json.loads(replies[1].request_body.response.body_mutation.streamed_response.body)
    assert forwarded["cache_salt"] == cache_salt_for("acme", router.salt_secret)  # admitted as its tenant


@pytest.mark.asyncio
async def test_a_completion_in_a_mode_without_body_is_refused_naming_the_mode_to_configure(picker) -> None:
    router, stub, _ = picker
    status, error, _ = refusal((await full_duplex(stub, [request_headers(mode=ProcessingMode.NONE)]))[0])
    message = error["error"]["message"]
    assert status == 500 and "NONE" in message and "FULL_DUPLEX_STREAMED" in message
    status, error, _ = refusal((await full_duplex(stub, [request_headers(end_of_stream=True)]))[0])
    assert status == 400 and "needs a JSON body" in error["error"]["message"]
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_fields_only_the_router_sets_are_dropped_from_a_clients_body(picker) -> None:
    """A client's kv_transfer would make the engine fetch KV from any address (server-side request forgery), its
    resume_output_ids would skip tokens: admission drops both on either edge; return_token_ids is the client's."""
    router, stub, _ = picker
    body = completion(21, kv_transfer={"mode": "pull", "source": "http://169.254.169.254", "tokens": 16},
                      resume_output_ids=[5, 6], return_token_ids=True)
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(body).encode())])
    forwarded = replies[1].request_body.response.body_mutation.streamed_response.body
    assert json.loads(forwarded) == completion(21, return_token_ids=True)
    headers = {h.header.key: h.header.raw_value.decode()
               for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert headers["content-length"] == str(len(forwarded))
    admitted = await router.admit(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "kv_transfer": {"mode": "decode", "source": "http://x", "handle": "h",
                                                              "first_token": 1}}).encode(), {}, chat=True)
    assert "kv_transfer" not in admitted.raw and admitted.body.kv_transfer is None and admitted.rewritten


@pytest.mark.asyncio
async def test_admission_errors_are_counted_on_both_edges(picker) -> None:
    router, stub, _ = picker
    bad = json.dumps({"model": MODEL, "prompt": [10**9], "max_tokens": 1}).encode()  # outside the vocabulary
    status, error, _ = refusal((await full_duplex(stub, [request_headers(), *body_chunks(bad)]))[0])
    assert status == 400 and "vocabulary" in error["error"]["message"]
    assert counted(router, "error") == 1
    http = TestClient(create_router_app(router))  # no lifespan: the pods stay as the test set them
    answer = http.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "vocabulary" in answer.json()["error"]["message"]
    assert counted(router, "error", "aggregated") == 1


# ---- bodies, answers, shutdown -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_buffered_body_over_grpcs_default_message_size_is_decided(picker) -> None:
    """BUFFERED mode sends the body whole in one gRPC message: 5 MiB is over gRPC's default 4 MiB."""
    router, stub, _ = picker
    body = completion(22, user="x" * (5 << 20))
    hold(router, POD_B, body)
    replies = await full_duplex(stub, [request_headers(mode=ProcessingMode.BUFFERED),
                                       *body_chunks(json.dumps(body).encode())])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert chosen(replies[1], "request_body") == endpoint_of(POD_B)


@pytest.mark.parametrize("mode", [ProcessingMode.BUFFERED, ProcessingMode.FULL_DUPLEX_STREAMED])
@pytest.mark.asyncio
async def test_a_body_over_the_limit_gets_413(picker, mode: int) -> None:
    router, stub, _ = picker
    payload = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    pieces = 1 if mode == ProcessingMode.BUFFERED else 40  # buffered: one gRPC message over 32 MiB
    replies = await full_duplex(stub, [request_headers(mode=mode), *body_chunks(payload, pieces)])
    status, error, _ = refusal(replies[-1])
    assert status == 413 and "32 MiB" in error["error"]["message"]
    assert counted(router, "error") == 1


def sse(*events: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.asyncio
async def test_a_streamed_answer_is_read_for_its_usage_across_chunk_boundaries(picker) -> None:
    router, stub, _ = picker
    usage = {"prompt_tokens": 96, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}}
    answer = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": usage})
    cut = answer.index(b'"cached_tokens"')  # the usage line split between two chunks
    chunks = [answer[:cut], answer[cut:]]
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(23)).encode()),
                                       *response_phases(chunks, content_type="text/event-stream")])
    echoed = [r.response_body.response.body_mutation.streamed_response.body for r in replies
              if r.WhichOneof("response") == "response_body"]
    assert b"".join(echoed) == answer
    assert router.metrics.actual._value.get() == 64
    assert counted(router, "ok") == 1 and all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.parametrize("compact", [False, True], ids=["engine", "compact"])
@pytest.mark.parametrize("client_asked", [False, True])
@pytest.mark.asyncio
async def test_a_stream_s_usage_is_asked_for_and_shown_only_to_a_client_that_asked(picker, client_asked: bool,
                                                                                   compact: bool) -> None:
    """The request log and the cached-tokens counter need a stream's usage: the engine is asked for it; a client
    that did not ask gets the stream without that chunk, and the others without their `"usage": null` (an engine
    writes it last; a pod of another make, `compact`, anywhere), as from the router's HTTP edge."""
    router, stub, _ = picker
    extra = {"stream": True, **({"stream_options": {"include_usage": True}} if client_asked else {})}
    usage = {"prompt_tokens": 96, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    first = {"usage": None, "choices": [{"text": "a"}]} if compact else {"choices": [{"text": "a"}], "usage": None}
    separators = (",", ":") if compact else None
    text = b"".join(b"data: " + json.dumps(event, separators=separators).encode() + b"\n\n"
                    for event in (first, {"choices": [], "usage": usage})) + b"data: [DONE]\n\n"
    cuts = text.index(b'"usage"'), text.rindex(b'"usage"')  # each usage line split between two chunks
    pieces = [text[: cuts[0]], text[cuts[0]: cuts[1]], text[cuts[1]:]]
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(26, **extra)).encode()),
                                       *response_phases(pieces, content_type="text/event-stream")])
    forwarded = json.loads(replies[1].request_body.response.body_mutation.streamed_response.body)
    assert forwarded["stream_options"]["include_usage"] is True
    echoed = b"".join(r.response_body.response.body_mutation.streamed_response.body for r in replies
                      if r.WhichOneof("response") == "response_body")
    if client_asked:
        assert echoed == text
    else:
        events = [line.removeprefix(b"data: ") for line in echoed.split(b"\n") if line]
        assert [json.loads(events[0]), events[1:]] == [{"choices": [{"text": "a"}]}, [b"[DONE]"]]
    assert router.metrics.actual._value.get() == 32


@pytest.mark.asyncio
async def test_an_engine_error_status_counts_as_an_error(picker) -> None:
    router, stub, _ = picker
    answer = json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode()
    await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(24)).encode()),
                             *response_phases(answer, status=500)])
    assert (counted(router, "error"), counted(router, "ok")) == (1, 0)
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.parametrize(("declared", "echoed"), [
    (ProcessingMode.FULL_DUPLEX_STREAMED, True), (ProcessingMode.STREAMED, False), (ProcessingMode.BUFFERED, False),
    (None, False),  # not said (an Envoy before 1.34): a streamed response could be a protocol error
])
@pytest.mark.asyncio
async def test_response_bodies_follow_the_mode_the_gateway_declared(picker, declared: int | None,
                                                                    echoed: bool) -> None:
    _, stub, _ = picker
    first = (request_headers(mode=None) if declared is None else
             request_headers(response_mode=declared))
    answer = b'{"usage": {"prompt_tokens": 96}}'
    replies = await full_duplex(stub, [first, *body_chunks(json.dumps(completion(25)).encode()),
                                       *response_phases(answer)])
    bodies = [r.response_body.response for r in replies if r.WhichOneof("response") == "response_body"]
    assert len(bodies) == 2
    assert all(b.HasField("body_mutation") == echoed for b in bodies)
    if echoed:
        assert bodies[0].body_mutation.streamed_response.body == answer


@pytest.mark.asyncio
async def test_a_failure_after_the_decision_gives_the_pod_back(picker, monkeypatch: pytest.MonkeyPatch) -> None:
    router, stub, _ = picker

    def broken(*_: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(router, "plan_pull", broken)
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(26)).encode())])
    status, _, _ = refusal(replies[0])
    assert status == 500 and counted(router, "error") == 1
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_shutdown_says_not_serving_and_lets_an_open_stream_finish(router: Router) -> None:
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub, check = health_checker(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert await check("readiness") == SERVING and (await asyncio.wait_for(watch.read(), 30)).status == SERVING
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers())
        for message in body_chunks(json.dumps(completion(27)).encode()):
            await call.write(message)
        assert (await call.read()).WhichOneof("response") == "request_headers"
        await call.read()
        # the drain period never runs out in this test; no minimum wait: only the open stream keeps it up
        stopping = asyncio.ensure_future(server.stop(drain=600, settle=0))
        assert (await asyncio.wait_for(watch.read(), 30)).status == NOT_SERVING  # told at once
        assert await check("readiness") == NOT_SERVING and await check("") == NOT_SERVING
        assert await check("liveness") == SERVING
        assert not stopping.done()  # the answer is still on its way
        for message in response_phases(b'{"usage": {"prompt_tokens": 96}}'):
            await call.write(message)
        await call.done_writing()
        replies = []
        while (reply := await call.read()) != grpc.aio.EOF:
            replies.append(reply.WhichOneof("response"))
        assert replies == ["response_headers", "response_body", "response_body", "response_trailers"]
        await stopping  # the last stream ended: the server stops without waiting out the drain period
    assert counted(router, "ok") == 1 and all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_shutdown_serves_new_streams_for_a_minimum_wait_even_with_none_open(router: Router) -> None:
    """A Gateway sees NOT_SERVING only at its next health check: a stream it opens before then is still served,
    and the picker stops no sooner than the minimum wait, though no stream was open when shutdown began."""
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)
    settle = 3.0  # a stream opens well within this on a loaded machine; the test takes this long
    events = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        _, check = health_checker(channel)
        began = time.monotonic()
        stopping = asyncio.ensure_future(server.stop(drain=600, settle=settle))
        stopping.add_done_callback(lambda _: events.append("stopped"))
        assert await check("") == NOT_SERVING
        replies = await full_duplex(pb_grpc.ExternalProcessorStub(channel),
                                    [request_headers(), *body_chunks(json.dumps(completion(28)).encode()),
                                     *response_phases(b'{"usage": {"prompt_tokens": 96}}')])
        events.append("stream served")
        assert chosen(replies[0]) in {endpoint_of(POD_A), endpoint_of(POD_B)}
        await stopping
    assert events == ["stream served", "stopped"]
    assert time.monotonic() - began >= settle  # the minimum wait was waited out, with nothing open
    assert counted(router, "ok") == 1 and all(p.inflight == 0 for p in router.pods.pods.values())


# ---- TLS: how gateways dial an endpoint picker -----------------------------------------------------------------


def write_pair(folder: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> bytes:
    """A new key and certificate as a mounted kubernetes.io/tls Secret holds them; returns the certificate. Each
    file is replaced whole (a new inode), as the kubelet swaps a Secret's files."""
    key, certificate = self_signed_certificate(names)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("tls.key", key), ("tls.crt", certificate)):
        (folder / f".{name}.new").write_bytes(data)
        os.replace(folder / f".{name}.new", folder / name)
    return certificate


async def pick_over_tls(port: int, root: bytes, router: Router, seed: int) -> str:
    """One full-duplex request through a channel that trusts only `root`, as a gateway that verifies would send it;
    the pod holding the prompt must be chosen."""
    body = completion(seed)
    hold(router, POD_B, body)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root)) as channel:
        replies = await full_duplex(pb_grpc.ExternalProcessorStub(channel),
                                    [request_headers(), *body_chunks(json.dumps(body).encode())])
    return chosen(replies[0])


@pytest.mark.asyncio
async def test_tls_is_the_default_with_a_self_signed_certificate_a_gateway_can_dial(router: Router) -> None:
    assert RouterConfig(pods=[POD_A], ext_proc_port=9002).ext_proc_tls, "TLS unless told otherwise"
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=True)
    try:
        assert server.certificate is not None and "TLS" in server.mode
        certificate = x509.load_pem_x509_certificate(server.certificate)
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "localhost" in names.get_values_for_type(x509.DNSName)
        assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
        lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
        assert datetime.timedelta(days=365) <= lifetime <= datetime.timedelta(days=366)
        assert certificate.not_valid_before_utc <= datetime.datetime.now(datetime.UTC)
        assert await pick_over_tls(port, server.certificate, router, 1) == endpoint_of(POD_B)
        # a client that verifies against another certificate is refused: the server really presents its own
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await pick_over_tls(port, self_signed_certificate(["localhost", "127.0.0.1"])[1], router, 2)
        assert wrong.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()
    assert sum(p.inflight for p in router.pods.pods.values()) == 0


@pytest.mark.asyncio
async def test_a_mounted_certificate_is_served_and_a_rotated_one_replaces_it(router: Router, tmp_path: Path) -> None:
    first = write_pair(tmp_path / "tls")
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=True, cert_dir=str(tmp_path / "tls"))
    try:
        assert server.certificate == first
        assert await pick_over_tls(port, first, router, 3) == endpoint_of(POD_B)
        second = write_pair(tmp_path / "tls")  # the Secret is renewed: the next connection gets the new pair
        assert await pick_over_tls(port, second, router, 4) == endpoint_of(POD_B)
        with pytest.raises(grpc.aio.AioRpcError):  # and the old certificate is no longer presented
            await pick_over_tls(port, first, router, 5)
        (tmp_path / "tls" / "tls.crt").write_bytes(b"half written")  # a broken rotation keeps the working pair
        assert await pick_over_tls(port, second, router, 6) == endpoint_of(POD_B)
    finally:
        await server.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("server_tls", [True, False])
async def test_a_client_of_the_other_kind_fails_at_once(router: Router, server_tls: bool) -> None:
    """A plaintext client against the TLS port (or a TLS client against a plaintext one) is refused at the
    handshake, well before its deadline: the gateway sees the picker unavailable and does not hang."""
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=server_tls)
    target = f"127.0.0.1:{port}"
    other = (grpc.aio.insecure_channel(target) if server_tls else
             grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(self_signed_certificate(["localhost"])[1])))
    try:
        async with other as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(iter([request_headers()]), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [reply async for reply in call]
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED: no hang
    finally:
        await server.stop()
    assert sum(p.inflight for p in router.pods.pods.values()) == 0


def test_cli_flags_choose_plaintext_or_a_certificate_directory(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli._router_parser(parser.add_subparsers())

    def config(*flags: str) -> RouterConfig:
        args = parser.parse_args(["router", "--pod", POD_A, "--ext-proc-port", "9002", *flags])
        return load_router_config(None, {f.name: getattr(args, f.name, None) for f in dataclasses.fields(RouterConfig)})

    assert (config().ext_proc_tls, config().ext_proc_cert_dir) == (True, None)
    assert config("--ext-proc-plaintext").ext_proc_tls is False
    write_pair(tmp_path)
    assert config("--ext-proc-cert-dir", str(tmp_path)).ext_proc_cert_dir == str(tmp_path)


@pytest.mark.parametrize(("settings", "message"), [
    (lambda d: {"ext_proc_cert_dir": str(d / "empty")}, "has no tls.crt and no tls.key"),
    (lambda d: {"ext_proc_cert_dir": str(d / "only_cert")}, "has no tls.key"),
    (lambda d: {"ext_proc_cert_dir": str(d / "pair"), "ext_proc_tls": False}, "ext_proc_tls is false"),
    (lambda d: {"ext_proc_tls": "yes"}, "must be true or false"),
])
def test_a_bad_tls_setting_is_refused_with_what_to_fix(tmp_path: Path, settings: object, message: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "only_cert").mkdir()
    (tmp_path / "only_cert" / "tls.crt").write_bytes(self_signed_certificate(["localhost"])[1])
    write_pair(tmp_path / "pair")
    section = {"pods": [POD_A], "ext_proc_port": 9002, **settings(tmp_path)}  # type: ignore[operator]
    (tmp_path / "router.yaml").write_text(json.dumps({"router": section}))
    with pytest.raises(ValueError, match=message):
        load_router_config(tmp_path / "router.yaml")


def test_the_cli_refuses_a_certificate_directory_without_its_files(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def run() -> int:
        return cli.main(["router", "--pod", POD_A, "--ext-proc-port", "9002", "--ext-proc-cert-dir", str(tmp_path)])

    assert run() == 2
    assert "has no tls.crt and no tls.key" in capsys.readouterr().err
    (tmp_path / "tls.crt").write_text("junk")
    (tmp_path / "tls.key").write_text("junk")
    assert run() == 2  # a message and exit 2 before anything starts, not a failed start-up
    assert "tls.crt is not a PEM certificate" in capsys.readouterr().err


@pytest.mark.asyncio
@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "tls.crt").write_text("not a certificate"), "tls.crt is not a PEM certificate"),
    (lambda d: (d / "tls.key").write_text("not a key"), "tls.key is not an unencrypted PEM private key"),
    (lambda d: (d / "tls.key").write_bytes(self_signed_certificate(["x"])[0]), "tls.key is not the key of"),
])
async def test_a_certificate_directory_that_is_no_matching_pair_is_refused(
        router: Router, tmp_path: Path, damage: object, message: str) -> None:
    write_pair(tmp_path)
    damage(tmp_path)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):  # by the configuration
        RouterConfig(pods=[POD_A], ext_proc_port=9002, ext_proc_cert_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match=message):  # and by the server, which does not start half-configured
        await start_ext_proc(router, "127.0.0.1", free_port(), tls=True, cert_dir=str(tmp_path))


# ---- beside the HTTP edge, in front of real engines ------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Router, bytes]]:
    """The router app serving ext_proc over TLS with a mounted pair, as configured in a cluster with a Secret."""
    certs = tmp_path_factory.mktemp("certs")
    certificate = write_pair(certs)
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("engines")) as procs:
        port = free_port()
        r = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1, ext_proc_port=port,
                                      ext_proc_cert_dir=str(certs)), tiny_dir)
        with serve_router(r) as url:
            yield url, port, r, certificate


async def gateway_pick(port: int, certificate: bytes, body: dict[str, object]) -> str:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(certificate)) as channel:
        replies = await full_duplex(pb_grpc.ExternalProcessorStub(channel),
                                    [request_headers(), *body_chunks(json.dumps(body).encode(), 2)])
    return chosen(replies[0])


def wait_indexed(router: Router, pod: str, body: dict[str, object]) -> None:
    """Until `pod`'s own events (not the router's provisional entries) report the prompt's blocks."""
    hashes = router.request_info(CompletionRequest.model_validate(body), 0).block_hashes
    for _ in range(100):
        match = router.index.match(hashes, [pod], None).get(pod)
        if match is not None and match.blocks == len(hashes):
            return
        time.sleep(0.1)
    raise AssertionError(f"{pod} never reported the prompt's blocks")


@pytest.mark.slow
def test_the_gateway_and_the_http_edge_choose_alike(served: tuple[str, int, Router, bytes]) -> None:
    url, port, router, certificate = served
    ids = prompt(11, 160)
    http = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert http.status_code == 200, http.text
    holder = http.headers["x-kvmesh-pod"]
    wait_indexed(router, holder, {"prompt": ids})
    for k in range(3):  # the same prefix, new suffixes: the gateway goes where the HTTP edge put it
        picked = asyncio.run(gateway_pick(port, certificate, {"prompt": [*ids, 7 + k], "max_tokens": 2}))
        assert picked == endpoint_of(holder)

    # and the other way round: what the gateway routes, the HTTP edge follows before any event confirms it
    fresh = prompt(12, 160)
    picked = asyncio.run(gateway_pick(port, certificate, {"prompt": fresh, "max_tokens": 2}))
    again = httpx.post(url + "/v1/completions", json={"prompt": [*fresh, 5], "max_tokens": 2}, timeout=60)
    assert again.status_code == 200 and endpoint_of(again.headers["x-kvmesh-pod"]) == picked
    metrics = httpx.get(url + "/metrics").text
    assert 'kvmesh_router_requests_total{outcome="ok",route="gateway",source="client"} 4.0' in metrics


@pytest.mark.asyncio
async def test_a_tenant_over_its_limit_gets_the_429_and_its_rate_limit_headers_through_the_gateway(picker) -> None:
    """The same limits as the HTTP edge: an answer carries the tenant's x-ratelimit-* (a response-headers
    mutation), and the refusal past the limit is a 429 with Retry-After and those headers."""
    router, stub, _ = picker
    router.keys = ApiKeys({hash_key("sk-acme"): "acme"})
    router.limits = Limiter(parse_tenants({"acme": {"requests_per_minute": 1}}))
    key = {"authorization": "Bearer sk-acme"}
    answer = b'{"usage": {"prompt_tokens": 96, "completion_tokens": 4}}'
    replies = await full_duplex(stub, [request_headers(**key), *body_chunks(json.dumps(completion(30)).encode()),
                                       *response_phases(answer)])
    mutation = replies[2].response_headers.response.header_mutation.set_headers
    served = {h.header.key: h.header.raw_value.decode() for h in mutation}
    assert served["x-ratelimit-limit-requests"] == "1" and served["x-ratelimit-remaining-requests"] == "0"

    replies = await full_duplex(stub, [request_headers(**key), *body_chunks(json.dumps(completion(31)).encode())])
    status, error, headers = refusal(replies[0])
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert float(headers["retry-after"]) > 0 and headers["x-ratelimit-remaining-requests"] == "0"
    assert counted(router, "rate_limited") == 1 and counted(router, "error") == 0
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_a_request_that_fails_after_admission_gives_its_slot_back_through_the_gateway(
        picker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault between admission and the booking (a prefix-pull plan failing, as a bug would) answers 500, and the
    tenant's one concurrency slot is free again at once: the next request is served."""
    router, stub, _ = picker
    router.limits = Limiter(parse_tenants({"default": {"max_concurrent_requests": 1}}))

    def broken(*_: object) -> None:
        raise RuntimeError("a bug past admission")

    monkeypatch.setattr(router, "plan_pull", broken)
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(50)).encode())])
    assert refusal(replies[0])[0] == 500 and router.limits.inflight == {}
    monkeypatch.undo()
    answer = b'{"usage": {"prompt_tokens": 96, "completion_tokens": 4}}'
    replies = await full_duplex(stub, [request_headers(), *body_chunks(json.dumps(completion(51)).encode()),
                                       *response_phases(answer)])
    assert chosen(replies[0]) in (endpoint_of(POD_A), endpoint_of(POD_B)) and router.limits.inflight == {}
    assert all(p.inflight == 0 for p in router.pods.pods.values())


@pytest.mark.asyncio
async def test_the_gateway_carries_the_pickers_trace_to_the_engine_and_ends_a_refused_requests_span(picker) -> None:
    """Tracing on: the choice's header mutation carries the router span's traceparent, so the engine's span is its
    child behind a Gateway too; a request refused after admission (a model no pod serves) still ends its span."""
    router, stub, _ = picker
    spans = InMemorySpanExporter()
    router.tracing = setup_tracing(ROUTER_SERVICE, None, exporter=spans)
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    answer = b'{"usage": {"prompt_tokens": 96, "completion_tokens": 4}}'
    replies = await full_duplex(stub, [request_headers(traceparent=client),
                                       *body_chunks(json.dumps(completion(40)).encode()), *response_phases(answer)])
    mutation = {h.header.key: h.header.raw_value.decode()
                for h in replies[0].request_headers.response.header_mutation.set_headers}
    (span,) = spans.get_finished_spans()
    assert span.context.trace_id == int(client.split("-")[1], 16)  # the client's trace, continued
    assert mutation["traceparent"].split("-")[1:3] == [client.split("-")[1], format(span.context.span_id, "016x")]

    spans.clear()
    unknown = json.dumps(completion(41, model="nope")).encode()
    refused = await full_duplex(stub, [request_headers(), *body_chunks(unknown)])
    assert refusal(refused[0])[0] == 404
    (span,) = spans.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 404
