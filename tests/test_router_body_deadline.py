"""Slow clients on every route of the router and `kvmesh gateway` that reads a body (engine/body_deadline.py,
around each whole app): a client that sends its headers and then trickles its body, or sends none, gets a 408
after body_read_timeout_seconds and its connection closed; it holds no pod, no tenant slot, and nobody else's
request waits on it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from kvmesh.engine.body_deadline import MIN_BODY_BYTES_PER_SECOND, BodyDeadline
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import TOKENIZE_PATH
from kvmesh.router.app import Router, build_router
from kvmesh.router.batches import RESPONSES_PATH
from kvmesh.router.config import RouterConfig
from kvmesh.router.gateway_app import Gateway, GatewayApp, static_routers

from .engines import serve_router, slow_client, wait_idle
from .test_gateway import serve_asgi
from .test_router_disconnect import wait_nothing_in_flight
from .test_server import served

__all__ = ["served"]  # the fixture: one in-process engine behind uvicorn

DEADLINE = 0.3


@dataclass
class Routed:
    engine: Engine
    router: Router
    url: str  # the router's


@pytest.fixture
def routed(served: tuple[str, Engine], tiny_dir: Path, tmp_path: Path) -> Iterator[Routed]:
    """The served engine behind a router with a short body deadline, one request at a time per tenant (a slot
    a slow client held would turn the next request into a 429) and a database (the Batch API's file uploads)."""
    config = RouterConfig(pods=[served[0]], body_read_timeout_seconds=DEADLINE, scrape_interval_seconds=0.1,
                          tenants={"default": {"max_concurrent_requests": 1}},
                          database_url=f"sqlite:///{tmp_path / 'pool.db'}")
    router = build_router(config, tiny_dir)
    with serve_router(router) as url:
        yield Routed(served[1], router, url)


def assert_body_timeout(answer: tuple[int, dict[str, str], dict]) -> None:
    status, headers, body = answer
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "body_timeout" and body["error"]["type"] == "invalid_request_error"
    assert f"the request body did not arrive within {DEADLINE:g} s" in body["error"]["message"]


def errors_counted(metrics: str) -> float:
    line = 'kvmesh_router_requests_total{outcome="error",route="aggregated",source="client"} '
    return next((float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line)), 0.0)


def test_a_slow_body_is_a_408_that_closes_the_connection_and_holds_nothing(routed: Routed) -> None:
    before = errors_counted(httpx.get(routed.url + "/metrics").text)
    for path, sent in (("/v1/completions", b""), ("/v1/chat/completions", b'{"messages": [{"role": "us')):
        assert_body_timeout(slow_client(routed.url, path, sent))
    assert errors_counted(httpx.get(routed.url + "/metrics").text) == before + 2
    assert routed.router.limits.inflight == {}  # no tenant slot held
    wait_nothing_in_flight(routed.router)
    ok = httpx.post(routed.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    wait_idle(routed.engine)


def test_every_other_route_that_reads_a_body_is_bounded_too_and_a_whole_upload_still_works(routed: Routed) -> None:
    """The Batch API's file upload (multipart), the Responses API and /tokenize: a 408 and the connection closed,
    counted in no completion series; an upload sent whole is stored as before."""
    before = errors_counted(httpx.get(routed.url + "/metrics").text)
    boundary = "kvmesh-slow"
    upload = f'--{boundary}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
    assert_body_timeout(slow_client(routed.url, "/v1/files", upload, f"multipart/form-data; boundary={boundary}"))
    assert_body_timeout(slow_client(routed.url, RESPONSES_PATH, b'{"input": "hel'))
    assert_body_timeout(slow_client(routed.url, TOKENIZE_PATH))
    assert errors_counted(httpx.get(routed.url + "/metrics").text) == before
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "fine", "max_tokens": 3}}) + "\n"
    stored = httpx.post(routed.url + "/v1/files", data={"purpose": "batch"},
                        files={"file": ("input.jsonl", line.encode(), "application/jsonl")}, timeout=30)
    assert stored.status_code == 200 and stored.json()["bytes"] == len(line)
    assert httpx.get(routed.url + f"/v1/files/{stored.json()['id']}/content").text == line


def test_a_stream_longer_than_the_body_deadline_is_relayed_whole(routed: Routed,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = routed.engine.runner.run
    monkeypatch.setattr(routed.engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", routed.url + "/v1/completions", json=body, timeout=30) as reply:
        chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert reply.status_code == 200 and len(chunks) == 60  # 0.6 s or more, twice the deadline
    wait_idle(routed.engine)


def test_the_gateway_answers_a_slow_body_408_and_closes_the_connection(routed: Routed) -> None:
    gateway = Gateway(static_routers([routed.url]), refresh_seconds=3600, body_read_timeout_seconds=DEADLINE)
    with serve_asgi(GatewayApp(gateway)) as url:
        assert_body_timeout(slow_client(url, "/v1/chat/completions", b'{"model": "'))
        metrics = httpx.get(url + "/metrics").text
        assert 'kvmesh_gateway_requests_total{model="unknown",outcome="bad_request"} 1.0' in metrics
        assert 'outcome="client_gone"' not in metrics  # the 408 is the one outcome, not a client that left too
        ok = httpx.post(url + "/v1/completions", json={"model": routed.engine.model_name, "prompt": "fine",
                                                       "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert routed.router.limits.inflight == {}
    wait_idle(routed.engine)


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_deadline_of_no_time_is_refused_at_start(seconds: float) -> None:
    with pytest.raises(ValueError, match="body_read_timeout_seconds must be above 0"):
        RouterConfig(pods=["http://127.0.0.1:1"], body_read_timeout_seconds=seconds).validate()
    with pytest.raises(ValueError, match="body_read_timeout_seconds must be above 0"):
        EngineConfig(body_read_timeout_seconds=seconds).validate()


def drive(seconds: float, chunks: list[bytes], gap_seconds: float) -> tuple[int, bytes]:
    """BodyDeadline around an app that reads the whole body and answers 200 with its length, driven as uvicorn
    would drive it (ASGI messages) by a client that sends `chunks` `gap_seconds` apart: the status and body."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    async def run() -> tuple[int, bytes]:
        pending = list(chunks)
        answer: dict[str, Any] = {}

        async def receive() -> Message:
            if not pending:
                await asyncio.Event().wait()  # a client that sends nothing more
            await asyncio.sleep(gap_seconds)
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

        async def send(message: Message) -> None:
            answer.setdefault("status", message.get("status"))
            answer["body"] = message.get("body", b"")

        scope = {"type": "http", "method": "POST", "path": "/v1/files", "headers": []}
        await BodyDeadline(app, lambda: seconds, lambda _: None)(scope, receive, send)
        return answer["status"], answer["body"]

    return asyncio.run(run())


def test_a_large_body_sent_at_a_fair_rate_is_not_cut_and_a_trickle_is() -> None:
    """The deadline grows by a second per MIN_BODY_BYTES_PER_SECOND received: a 100 MiB batch file on a link of a
    few MiB/s takes longer than 30 s and must still arrive, while a client that trickles a few bytes at a time
    gains next to nothing. Here a 0.5 s deadline and eight 64 KiB chunks 0.1 s apart (0.8 s in all, 8 s earned)
    are read whole; 10-byte chunks at the same pace are a 408."""
    fair = [b"x" * MIN_BODY_BYTES_PER_SECOND] * 8
    assert drive(0.5, fair, 0.1) == (200, str(8 * MIN_BODY_BYTES_PER_SECOND).encode())
    status, body = drive(0.5, [b"y" * 10] * 8, 0.1)
    assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout"
